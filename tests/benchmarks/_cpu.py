"""CPU seconds spent by the processes of a world: what a benchmark's work costs on machines
where every rank has cores of its own (on 2 shared cores, wall time hides it).

Read per process, user + system time of every thread, live or ended: from the process's CPU
clock (``clock_gettime`` on the clock id that glibc's ``clock_getcpuclockid`` builds, exact to
the nanosecond), else from ``/proc/<pid>/stat`` (in clock ticks of 10 ms, so a window should
then last well over 10 ms per process). Linux only: elsewhere :func:`process_cpu_seconds`
returns None and the benchmarks print no CPU figures.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Iterable

import torch.distributed.rpc as rpc

from rpc_backend import current_worker

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _process_clock(pid: int) -> int:
    """The CPU-time clock id of process ``pid`` (all its threads), as Linux encodes it:
    ``MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)``."""
    return (~pid << 3) | 2


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (all its threads), None when unreadable."""
    if sys.platform != "linux":
        return None
    try:
        return time.clock_gettime(_process_clock(pid))
    except OSError:  # a kernel without per-process CPU clocks: the coarser /proc figure
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces: count fields after its closing parenthesis
    fields = text[text.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def world_pids(names: Iterable[str]) -> list[int]:
    """This process's pid and the pid of every worker in ``names`` (asked over RPC; the
    workers run on this machine)."""
    pids = [os.getpid()]
    for name in names:
        pid = rpc.rpc_sync(name, os.getpid)
        if pid not in pids:
            pids.append(pid)
    return pids


def world_meter() -> CpuMeter:
    """A :class:`CpuMeter` over every process of this process's world (``run_local`` or
    ``init_from_env``): itself and each of its peers. Called on the rank that drives."""
    me = current_worker()
    return CpuMeter(world_pids(name for name in me.names if name != me.name))


class CpuMeter:
    """CPU seconds of ``pids`` summed, between :meth:`start` and :meth:`stop`.

    Example::

        meter = CpuMeter(world_pids(["worker1", "worker2"]))
        meter.start(); work(); cpu = meter.stop()   # None off Linux
    """

    def __init__(self, pids: Iterable[int]) -> None:
        self.pids = list(pids)
        self._start: list[float | None] = []

    def read(self) -> list[float | None]:
        return [process_cpu_seconds(pid) for pid in self.pids]

    def start(self) -> None:
        self._start = self.read()

    def stop_each(self) -> list[float | None]:
        """CPU seconds of each pid since :meth:`start` (None where unreadable)."""
        return [None if a is None or b is None else b - a for a, b in zip(self._start, self.read())]

    def stop(self) -> float | None:
        each = self.stop_each()
        return None if any(v is None for v in each) else sum(each)  # type: ignore[arg-type]
