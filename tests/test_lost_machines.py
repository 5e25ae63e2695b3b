"""A lost machine across simulated machines (tests/_machines.py): its processes killed, or its
link down. Every surviving rank, server included, names the lost workers with their machine
and step, the job exits non-zero and nothing hangs; an expendable role's loss is reported and
the job completes.

Each job is tests/_lost_job.py under the static two-machine torchrun command of
tests/test_machines.py, with the default heartbeats (every 1 s, lost after 10 s). The test
notes the wall-clock time at which it breaks a machine; the survivors' log lines carry the
wall-clock time at which they noticed (the same clock: namespaces share it), so the detection
latency printed is measured by the survivors themselves, not by this process's polling. What
is asserted holds at any speed: a verdict comes after the break, the silence it reports is
at least the bound, and the job ends within the hang guard. Needs root, ``ip`` and
``unshare``; skips with the reason elsewhere (CI runs as root).
"""

from __future__ import annotations

import re
import subprocess
import time
from typing import NamedTuple

import pytest

from rpc_backend.watch import DEFAULT_HEARTBEAT_S, DEFAULT_LOST_AFTER_S
from tests import _machines
from tests._deadlines import HANG_S, SETUP_S
from tests.test_torchrun import _argv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(SETUP_S + 3 * HANG_S)]

PORT = "29400"
#: steps each trainer makes before the test breaks a machine (so that steps are reported)
STEPS_BEFORE = 20


def _torchrun(nproc: int, node_rank: int, roles: str, extra: str = "") -> list[str]:
    return _argv(f"torchrun --nnodes=2 --nproc-per-node={nproc} --node-rank={node_rank} --master-addr=machine0 "
                 f"--master-port={PORT} -m tests._lost_job --roles {roles} {extra}")


def _label(machine: _machines.Machine) -> str:
    """How a rank names a machine of these jobs (its node rank is its index)."""
    return f"{machine.hostname} ({machine.address}, torchrun group rank {machine.index})"


def _last_step(output: str, name: str) -> int:
    steps = re.findall(rf"^\S+ {name} step (\d+)$", output, re.MULTILINE)
    return int(steps[-1]) if steps else 0


def _wait_for_steps(job: _machines.Job, trainers: list[str]) -> None:
    deadline = time.monotonic() + SETUP_S
    while not all(_last_step(job.stdout(), t) >= STEPS_BEFORE for t in trainers):
        assert all(p.returncode is None for p in job.processes), job.report()
        assert time.monotonic() < deadline, f"{trainers} did not make {STEPS_BEFORE} steps\n{job.report()}"
        try:
            job.processes[0].popen.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass


class Verdict(NamedTuple):
    """One rank's log line naming what it lost."""

    at: float  # wall-clock time of the line
    lost: str  # the workers and machines named
    noticed: str  # "noticed here" or "noticed by <peer>"
    rank: str  # the rank that ends


VERDICT = re.compile(r"^(\d+\.\d+) ERROR rpc_backend\.watch: rpc_backend: lost (.*) \((noticed [^:]+): lost after "
                     r"[\d.]+ s without a heartbeat, \S+ sets it\); ending (\w+)$", re.MULTILINE)


def _verdicts(process: _machines.Process) -> dict[str, Verdict]:
    found = [Verdict(float(m[1]), m[2], m[3], m[4]) for m in VERDICT.finditer(process.stderr())]
    return {v.rank: v for v in found}


def _check_verdict(verdict: Verdict, broke: float, lost: list[tuple[str, int]], machine: str, job) -> float:
    """The verdict names each ``(worker, rank)`` of ``lost`` on ``machine``, comes after the break,
    and (noticed here) after a silence of at least the bound; returns its latency."""
    for name, rank in lost:
        assert re.search(rf"{name} \(rank {rank}, pid \d+, ", verdict.lost), (verdict, job.report())
    assert verdict.lost.endswith(f" on {machine}"), (verdict, job.report())
    assert verdict.at > broke, (verdict, broke)  # no verdict before the machine was lost
    if verdict.noticed == "noticed here":
        silences = [float(s) for s in re.findall(r"not heard from for ([\d.]+) s", verdict.lost)]
        assert max(silences) >= DEFAULT_LOST_AFTER_S, verdict
    latency = verdict.at - broke
    assert latency < HANG_S, verdict
    return latency


def _report(what: str, latencies: dict[str, float]) -> None:
    figures = ", ".join(f"{rank} {latency:.1f} s" for rank, latency in sorted(latencies.items()))
    print(f"\n{what}: named after {figures} (heartbeat {DEFAULT_HEARTBEAT_S:g} s, lost after "
          f"{DEFAULT_LOST_AFTER_S:g} s)")


def test_a_killed_machine_is_named_by_every_survivor_and_the_job_fails(two):
    m0, m1 = two.machines  # machine0: ps0 and trainer0; machine1: trainer1
    job = two.run({m0: _torchrun(2, 0, "ps:1,trainer:2"), m1: _torchrun(1, 1, "ps:1,trainer:2")},
                  env=_machines.clean_env())
    _wait_for_steps(job, ["trainer0", "trainer1"])
    broke = time.time()
    _machines.kill_namespace_processes(m1.netns)
    survivor, lost = job.processes
    job.wait(HANG_S, stop_on_failure=False)
    assert lost.returncode == -9 and not survivor.stopped, job.report()
    assert survivor.returncode not in (0, None), job.report()  # torchrun fails the job
    verdicts = _verdicts(survivor)
    assert set(verdicts) == {"ps0", "trainer0"}, job.report()  # the server too
    assert "noticed here" in {v.noticed for v in verdicts.values()}, verdicts
    last = _last_step(job.stdout(), "trainer1")
    latencies = {}
    for rank, verdict in verdicts.items():
        latencies[rank] = _check_verdict(verdict, broke, [("trainer1", 2)], _label(m1), job)
        step = int(re.search(r"at step (\d+) of PSModel 'lost'", verdict.lost).group(1))
        assert 1 <= step <= last, (verdict, last)  # as of its last heartbeat
    _report("SIGKILL of machine1", latencies)


def test_a_killed_server_machine_is_named_by_the_trainers(two):
    # the servers' machine lost: a trainer's calls to ps0 may fail on the broken connection
    # (EPIPE, EOF) before the heartbeats name it; that error names its machine too
    m0, m1 = two.machines  # machine0: trainer0 and trainer1; machine1: ps0
    job = two.run({m0: _torchrun(2, 0, "trainer:2,ps:1"), m1: _torchrun(1, 1, "trainer:2,ps:1")},
                  env=_machines.clean_env())
    _wait_for_steps(job, ["trainer0", "trainer1"])
    _machines.kill_namespace_processes(m1.netns)
    survivor, lost = job.processes
    job.wait(HANG_S, stop_on_failure=False)
    assert lost.returncode == -9 and not survivor.stopped, job.report()
    assert survivor.returncode not in (0, None), job.report()
    where = re.escape(_label(m1))
    named = re.findall(rf"lost ps0 \(rank 2, [^)]*\) on {where}|worker 'ps0' on {where} failed", survivor.stderr())
    assert named, job.report()


def test_a_machine_behind_a_link_gone_down_is_named_on_both_sides(two):
    m0, m1 = two.machines  # machine0: ps0 (and the job's store); machine1: trainer0, trainer1
    job = two.run({m0: _torchrun(1, 0, "ps:1,trainer:2"), m1: _torchrun(2, 1, "ps:1,trainer:2")},
                  env=_machines.clean_env())
    _wait_for_steps(job, ["trainer0", "trainer1"])
    broke = time.time()
    subprocess.run(["ip", "-n", m0.netns, "link", "set", m0.interface, "down"], check=True, timeout=HANG_S)
    job.wait(HANG_S, stop_on_failure=False)
    assert all(p.returncode not in (0, None) and not p.stopped for p in job.processes), job.report()
    first, second = (_verdicts(p) for p in job.processes)
    assert set(first) == {"ps0"} and set(second) == {"trainer0", "trainer1"}, job.report()
    latencies = {"ps0": _check_verdict(first["ps0"], broke, [("trainer0", 1), ("trainer1", 2)], _label(m1), job)}
    for rank, verdict in second.items():  # the trainers lost the server and the store's machine
        latencies[rank] = _check_verdict(verdict, broke, [("ps0", 0)], _label(m0), job)
    _report("link of machine0 down", latencies)


def test_an_expendable_machine_is_reported_and_the_job_completes(two):
    m0, m1 = two.machines  # machine0: ps0 and trainer0; machine1: replica0 (expendable)
    extra = "--expendable replica --after-loss 5"
    roles = "ps:1,trainer:1,replica:1"
    job = two.run({m0: _torchrun(2, 0, roles, extra), m1: _torchrun(1, 1, roles, extra)}, env=_machines.clean_env())
    _wait_for_steps(job, ["trainer0"])
    broke = time.time()
    _machines.kill_namespace_processes(m1.netns)
    survivor = job.processes[0]
    deadline = time.monotonic() + HANG_S
    # both ranks finish their work and exit 0 (torchrun's agent then waits in its exit barrier
    # for the lost machine's agent, up to its own 300 s: tutorials/torchrun.md says so)
    while not ("trainer0 done" in survivor.stdout() and "ps0 done" in survivor.stdout()
               and _worker_pids(survivor) == []):
        assert survivor.returncode in (None, 0), job.report()
        assert time.monotonic() < deadline, job.report()
        try:
            survivor.popen.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
    assert survivor.returncode in (None, 0), job.report()
    out, err = survivor.stdout(), survivor.stderr()
    assert "trainer0 goes on without replica0" in out, job.report()
    spared = re.findall(r"^(\d+\.\d+) WARNING rpc_backend\.watch: rpc_backend: lost replica0 \(rank 2, pid \d+, "
                        r".*\) on (.*), of the expendable role 'replica': the job goes on", err, re.MULTILINE)
    assert len(spared) == 2 and {where for _, where in spared} == {_label(m1)}, job.report()  # ps0, trainer0
    assert "WorkerLost" not in err and "Traceback" not in err, job.report()
    assert all(float(at) > broke for at, _ in spared), (spared, broke)
    _report("SIGKILL of machine1 (expendable)", {f"rank{i}": float(at) - broke for i, (at, _) in enumerate(spared)})


def _worker_pids(process: _machines.Process) -> list[int]:
    """The processes left on the machine besides its torchrun agent (the job's ranks)."""
    listed = subprocess.run(["ip", "netns", "pids", process.machine.netns], capture_output=True, text=True,
                            timeout=HANG_S).stdout.split()
    return [int(p) for p in listed if p.isdigit() and int(p) != process.popen.pid]
