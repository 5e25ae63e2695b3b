"""Opt-in pytest plugin: wall time and machine-wide CPU seconds per test file.

    python -m pytest -p tests._cpuprof

CPU is read from /proc/stat (every process on the machine, helper ranks and spawned worlds
included), so the figures mean something only on an otherwise quiet machine. The suite's
budget is CPU-bound on 2 cores: this says which files to make cheaper. Linux only; elsewhere
the plugin reports nothing.
"""

from __future__ import annotations

import collections
import os
import time

_rows: list[tuple[str, float, float]] = []
_start: dict[str, float] = {}


def _cpu_seconds() -> float | None:
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    busy = sum(fields) - fields[3] - fields[4]  # minus idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


def pytest_runtest_logstart(nodeid, location):
    cpu = _cpu_seconds()
    if cpu is not None:
        _start.update(cpu=cpu, wall=time.monotonic())


def pytest_runtest_logfinish(nodeid, location):
    cpu = _cpu_seconds()
    if cpu is not None and _start:
        _rows.append((nodeid, time.monotonic() - _start["wall"], cpu - _start["cpu"]))


def pytest_terminal_summary(terminalreporter):
    if not _rows:
        return
    per_file: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for nodeid, wall, cpu in _rows:
        entry = per_file[nodeid.split("::")[0]]
        entry[0] += wall
        entry[1] += cpu
        entry[2] += 1
    tr = terminalreporter
    tr.section("CPU seconds (machine-wide) and wall seconds per test file")
    tr.write_line(f"{'cpu':>8} {'wall':>8} {'tests':>6}  file")
    for name, (wall, cpu, count) in sorted(per_file.items(), key=lambda kv: -kv[1][1])[:40]:
        tr.write_line(f"{cpu:8.1f} {wall:8.1f} {count:6d}  {name}")
    total_wall = sum(r[1] for r in _rows)
    total_cpu = sum(r[2] for r in _rows)
    tr.write_line(f"{total_cpu:8.1f} {total_wall:8.1f} {len(_rows):6d}  all tests")
