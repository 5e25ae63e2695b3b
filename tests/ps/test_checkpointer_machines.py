"""The Checkpointer under ``torchrun --max-restarts=1`` across simulated machines (tests/_machines.py)
with a whole machine lost (issue 44, acceptance: "on the multi-machine harness too"): machine0
runs ps0, machine1 trainer0 and trainer1 (tests/ps/_checkpoint_machines_job.py: sync mode,
batches by step index, a checkpoint every 2 of 6 steps in one directory every machine sees, which
stands for a shared filesystem). The test kills every process of one machine, its torchrun agent
included, while the trainers wait before step 5, then starts that machine's torchrun again (the
machine comes back): the world re-forms, resumes from the newest complete checkpoint, and ends
bit for bit as the uninterrupted run on the same machines.

The configuration that re-forms: c10d's rendezvous (``--rdzv-backend=c10d``, ``--nnodes=2``)
with its store on the machine that is not lost (``--rdzv-endpoint``; the store lives in that
machine's agent), and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``. By default torch's c10d handler
shares one store between its rounds for the workers (the agent store, hosted by the agent of
group rank 0) and an agent of another rank keeps the address of the first round's for good
(``DynamicRendezvousHandler.next_rendezvous``: ``_bootstrap_store_info`` is built once). When
the machine of group rank 0 is lost and comes back, its new agent hosts a new store on another
port, and the surviving machine's workers are sent to the old one, which no longer answers: the
world never forms again (pytorch/pytorch#135712). With the variable set, each round's rank 0
publishes a fresh address and port in the round's keys, and its rank-0 worker hosts the store;
without the agent store a rank on that machine cannot learn another machine's address, so the
interface is named (``TP_SOCKET_IFNAME``, ``GLOO_SOCKET_IFNAME``). The surviving agent restarts
its workers when they end on the lost peer (its one restart) or when the new agent arrives (a
membership change), and the round waits for both machines. c10d ranks the machines by hostname,
so machine0 is group rank 0 (ps0) in every round. Needs root, ``ip`` and ``unshare``; skips
with the reason elsewhere (CI runs as root).
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from tests import _machines
from tests._deadlines import HANG_S, SETUP_S
from tests.ps.test_checkpointer_torchrun import _bit_equal, _ends
from tests.test_torchrun import _argv

#: a job forms its world at most twice (its start, the restart), each step bounded
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * (2 * SETUP_S + 2 * HANG_S))]

PORT = "29400"  # the rendezvous store's, on the machine that is not lost
#: processes per machine: machine0 ps0, machine1 trainer0 and trainer1 (ranks by hostname)
NPROC = (1, 2)
PAUSE = 5


def _torchrun(nproc: int, endpoint: str, ckpt: Path, out: Path, extra: str = "") -> list[str]:
    return _argv(f"torchrun --nnodes=2 --nproc-per-node={nproc} --max-restarts=1 --rdzv-backend=c10d "
                 f"--rdzv-endpoint={endpoint}:{PORT} --rdzv-id=ckpt -m tests.ps._checkpoint_machines_job "
                 f"--dir {ckpt} --out {out} --steps 6 --every 2 {extra}")


def _env() -> dict[str, str]:
    """A fresh machine's environment, with the settings under which a world re-forms after a
    machine is lost: each round's store hosted by its rank 0 (torch's agent store, shared
    between rounds, keeps the first round's address), and so the interface named (without the
    agent store, a rank on the store's machine cannot learn another machine's address)."""
    return _machines.clean_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", TP_SOCKET_IFNAME="eth0",
                               GLOO_SOCKET_IFNAME="eth0")


def _dirs(tmp: Path) -> tuple[Path, Path]:
    ckpt, out = tmp / "ckpt", tmp / "out"
    out.mkdir(parents=True)
    return ckpt, out


def _wait_until(job: _machines.Job, done, what: str, timeout: float) -> None:
    """Poll ``job``'s output until ``done(stdout)``, at most ``timeout`` s; fails if a process exits first."""
    deadline = time.monotonic() + timeout
    while not done(job.stdout()):
        assert all(p.returncode is None for p in job.processes), f"exited before {what}\n{job.report()}"
        assert time.monotonic() < deadline, f"not {what} within {timeout:.0f} s\n{job.report()}"
        try:
            job.processes[0].popen.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass


def _resumed(stdout: str) -> dict[str, list[int]]:
    """Each trainer's steps resumed from, in order (its first start, then each restart)."""
    got: dict[str, list[int]] = {}
    for m in re.finditer(r"^(trainer\d) resumed from step (\d+) \(attempt \d+\)", stdout, re.M):
        got.setdefault(m[1], []).append(int(m[2]))
    return got


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The job on the same two machines, nothing lost: each trainer's end."""
    reason = _machines.missing_requirements()
    if reason:
        pytest.skip(reason)
    ckpt, out = _dirs(tmp_path_factory.mktemp("whole"))
    with _machines.machines(2) as cluster:
        job = cluster.run({m: _torchrun(NPROC[m.index], "machine0", ckpt, out) for m in cluster.machines},
                          env=_env())
        job.wait(SETUP_S + HANG_S)
        assert job.returncodes() == [0, 0], job.report()
        assert _resumed(job.stdout()) == {"trainer0": [0], "trainer1": [0]}, job.report()
    return _ends(out)


@pytest.mark.parametrize("lost", ["server", "trainers"])
def test_a_lost_machine_comes_back_and_the_job_ends_as_uninterrupted(tmp_path, uninterrupted, lost):
    ckpt, out = _dirs(tmp_path)
    started = time.monotonic()
    with _machines.machines(2) as cluster:
        m0, m1 = cluster.machines
        victim, survivor = (m0, m1) if lost == "server" else (m1, m0)
        commands = {m: _torchrun(NPROC[m.index], survivor.hostname, ckpt, out, f"--pause-at {PAUSE}")
                    for m in cluster.machines}
        env = _env()
        job = cluster.run(commands, env=env)
        _wait_until(job, lambda s: all(f"trainer{t} paused before step {PAUSE}" in s for t in (0, 1)),
                    f"paused before step {PAUSE}", SETUP_S)
        _machines.kill_namespace_processes(victim.netns)  # the machine is lost: agent and workers
        gone, kept = job.processes[victim.index], job.processes[survivor.index]
        gone.popen.wait(timeout=HANG_S)
        assert gone.returncode == -9 and kept.returncode is None, job.report()
        back = cluster.run({victim: commands[victim]}, env=env)  # the machine comes back
        world = _machines.Job([kept, back.processes[0]]).wait(2 * SETUP_S + HANG_S)
        report = job.report() + "\n=== after the machine came back\n" + back.report()
        assert world.returncodes() == [0, 0], report
        resumed = _resumed(job.stdout() + back.stdout())  # (the logs go with the machines)
    seconds = time.monotonic() - started
    for trainer in ("trainer0", "trainer1"):
        first, *restarts = resumed[trainer]
        assert first == 0 and len(restarts) == 1, (trainer, resumed, report)
        # the newest complete checkpoint before the pause: 4 (or 2, had step 4's not completed)
        assert restarts[0] in (2, 4), (trainer, resumed, report)
    assert resumed["trainer0"][1] == resumed["trainer1"][1], resumed
    _bit_equal(_ends(out), uninterrupted)
    print(f"\n{lost} machine lost before step {PAUSE}, back, resumed from step {resumed['trainer0'][1]}: "
          f"{seconds:.0f} s")
