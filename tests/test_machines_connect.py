"""Joining a world across simulated machines (tests/_machines.py) when it cannot form, and
forming it again after a torchrun restart (rpc_backend/connect.py).

Each job runs the guide's two-machine commands with tests/backend/scripts/attempts_job.py and
is left to end by itself (``stop_on_failure=False``): a rank the harness had to stop is a hang.
The failing jobs set ``RPC_BACKEND_CONNECT_TIMEOUT`` short; what they check holds at any speed:
every torchrun exits non-zero by itself, and each rank that fails names its own address and
interface, the peers it tried, and what to set. Needs root, ``ip`` and ``unshare``; skips with
the reason elsewhere (CI runs as root).
"""

import re

import pytest

from tests import _machines
from tests._deadlines import HANG_S, SETUP_S
from tests.test_torchrun import COMMANDS, DLRM_COMMANDS, _argv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(SETUP_S + HANG_S + 300)]

PORT = "29400"
JOB = "tests/backend/scripts/attempts_job.py"
#: the bound of the failing jobs (seconds): short, so that the tests are; any value works
BOUND = "30"
JOB_S = SETUP_S + HANG_S


def _static(cluster, envs) -> _machines.Job:
    """The guide's static pair (HOST0 the first machine's address) with the attempts job; each
    machine's torchrun with its own environment; left to end by itself."""
    m0, m1 = cluster.machines
    jobs = []
    for machine, command in zip((m0, m1), COMMANDS[1:]):
        argv = _argv(command.replace("tutorials/torchrun_job.py", JOB), HOST0=m0.address, PORT=PORT)
        jobs.append(cluster.run({machine: argv}, env=envs[machine]))
    for job in jobs:
        job.wait(JOB_S, stop_on_failure=False)
    return _machines.Job([job.processes[0] for job in jobs])


def _ended_by_itself_failing(job) -> None:
    assert not any(p.stopped for p in job.processes), job.report()  # nothing hung
    assert all(p.returncode not in (0, None) for p in job.processes), job.report()


def _connect_errors(process) -> list[str]:
    return re.findall(r"ConnectError: (rank \d .*)", process.stderr())


def _named_fix(text: str, machine) -> None:
    """What every report says: who failed where, its own address, and a fix."""
    assert re.match(rf"rank \d \(\w+\) on {machine.hostname} could not join the RPC world: ", text), text
    assert (f"This rank listens on {machine.address} (eth0" in text or "This rank listens on 127.0.0.1 (lo" in text
            or "This rank had not chosen its address yet" in text), text
    assert "it tried its peers at: " in text and "To fix: " in text, text
    assert "TP_SOCKET_IFNAME and GLOO_SOCKET_IFNAME" in text or "RPC_BACKEND_CONNECT_TIMEOUT" in text, text


def test_a_peer_that_dies_while_the_world_forms(two):
    # trainer2 (rank 3, the second machine) dies right before init_from_env: its torchrun stops
    # the machine's other rank and exits; the first machine's ranks, whose world can no longer
    # form (torch would wait in Gloo's connectFullMesh), fail within the bound naming it
    m0, m1 = two.machines
    env = _machines.clean_env(ATTEMPTS_JOB_DIE="3:before_init", RPC_BACKEND_CONNECT_TIMEOUT=BOUND)
    job = _static(two, {m0: env, m1: env})
    _ended_by_itself_failing(job)
    first, second = job.processes
    assert "rank 3: killing itself (before_init)" in second.stdout(), job.report()
    errors = _connect_errors(first)
    assert errors, job.report()
    for text in errors:
        _named_fix(text, m0)
        assert re.search(r"rank\(s\) [^:]*\b3\b[^:]* never arrived", text), text
        assert f"the bound: connect_timeout or RPC_BACKEND_CONNECT_TIMEOUT={BOUND} s" in text, text


def test_a_firewall_that_lets_only_the_master_port_through(two):
    # the second machine reaches the first only on MASTER_PORT (the others are refused, as a
    # firewall's REJECT does): torchrun's rendezvous works, TensorPipe's and Gloo's ports do not
    m0, m1 = two.machines
    for rule in (["to", m0.address, "ipproto", "tcp", "dport", PORT, "lookup", "main", "prio", "100"],
                 ["to", m0.address, "ipproto", "udp", "lookup", "main", "prio", "101"],
                 ["to", m0.address, "prohibit", "prio", "200"]):
        made = m1.run(["ip", "rule", "add", *rule], timeout=HANG_S)
        assert made.returncode == 0, made.stderr
    env = _machines.clean_env(RPC_BACKEND_CONNECT_TIMEOUT=BOUND)
    job = _static(two, {m0: env, m1: env})
    _ended_by_itself_failing(job)
    for process in job.processes:
        errors = _connect_errors(process)
        assert errors, job.report()
        for text in errors:
            _named_fix(text, process.machine)
            if all(f"on {m.hostname} at {m.address} (eth0)" in text for m in (m0, m1)):
                assert "reach each other on every TCP port, not only MASTER_PORT" in text, text
    # the second machine's own connections are refused, and torch's error says so
    assert any("Permission denied" in text for text in _connect_errors(job.processes[1])), job.report()


def test_a_wrong_interface_on_one_machine(two):
    # the second machine names loopback as its interface: its ranks advertise 127.0.0.1, which
    # the first machine's ranks cannot reach; both sides say where to set what
    m0, m1 = two.machines
    envs = {m0: _machines.clean_env(RPC_BACKEND_CONNECT_TIMEOUT=BOUND),
            m1: _machines.clean_env(RPC_BACKEND_CONNECT_TIMEOUT=BOUND, TP_SOCKET_IFNAME="lo", GLOO_SOCKET_IFNAME="lo")}
    job = _static(two, envs)
    _ended_by_itself_failing(job)
    texts = []
    for process in job.processes:
        errors = _connect_errors(process)
        assert errors, job.report()
        for text in errors:
            _named_fix(text, process.machine)
            texts.append(text)
    for text in _connect_errors(job.processes[1]):
        assert "This rank listens on 127.0.0.1 (lo, TP_SOCKET_IFNAME set in the environment)" in text, text
    for text in texts:
        if re.search(r"on machine1 at 127\.0\.0\.1 \(lo\)", text) or "This rank listens on 127.0.0.1" in text:
            assert "set TP_SOCKET_IFNAME and GLOO_SOCKET_IFNAME on machine1" in text, text


def test_a_restart_after_a_killed_trainer_forms_the_world_again(two):
    # the guide's c10d form (its rendezvous on the first machine, which is not the one that
    # fails) with --max-restarts=1: trainer2 (rank 3, second machine) dies after the first step;
    # both machines restart their workers, which form a new world, and the job completes.
    # torchrun's restart count is 1 on the second machine but may stay 0 on the first (a
    # healthy group restarted for a new round is not counted): the world is the same
    command = DLRM_COMMANDS[1].replace("-m remote_module.demos.dlrm --servers 2", f"--max-restarts=1 {JOB}")
    argv = _argv(command, HOST0=two.machines[0].hostname, PORT=PORT)
    env = _machines.clean_env(ATTEMPTS_JOB_DIE="3:after_init")
    job = two.run({m: argv for m in two.machines}, env=env).wait(JOB_S)
    assert job.returncodes() == [0, 0], job.report()
    assert "rank 3: killing itself (after_init)" in job.stdout(), job.report()
    finished = re.findall(r"^(\w+): attempt \d done in ([\w/]+)", job.stdout(), re.M)
    assert sorted(name for name, _ in finished) == ["ps0", "trainer0", "trainer1", "trainer2"], job.report()
    worlds = {world for _, world in finished}
    assert len(worlds) == 1 and worlds != {"rpc_backend/world1"}, job.report()  # one world, not the first
