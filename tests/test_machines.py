"""Jobs across simulated machines (tests/_machines.py): the guide's commands as written.

Each machine is a network namespace with its own address, hostname and hosts file in the
layout Debian and Ubuntu installs write (its own hostname on 127.0.1.1). No network variable
is set: ``rpc_backend`` finds each machine's interface itself (rpc_backend/network.py).
Needs root, ``ip`` and ``unshare``; skips with the reason elsewhere (CI runs as root).
"""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import _machines
from tests._deadlines import HANG_S, SETUP_S
from tests.test_torchrun import COMMANDS, DLRM_COMMANDS, _argv, _check

pytestmark = [pytest.mark.slow, pytest.mark.timeout(SETUP_S + HANG_S + 300)]

PORT = "29400"  # each machine is a fresh network namespace: every port is free
#: a job: its world forms, then a few seconds of work
JOB_S = SETUP_S + HANG_S


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _wait_for(path, text: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + HANG_S
    while text not in path.read_text():
        assert process.poll() is None, f"exited {process.returncode} before printing {text!r}"
        assert time.monotonic() < deadline, f"{text!r} not printed within {HANG_S} s"
        try:
            process.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass


LISTEN = """
import socket, sys
s = socket.socket()
s.bind(("0.0.0.0", 29401)); s.listen()
print("listening", flush=True)
conn, peer = s.accept()
print("accepted", peer[0], flush=True)
"""

CONNECT = """
import socket, sys
for host in sys.argv[1:]:
    try:
        socket.create_connection((host, 29401), timeout=60).close()
        print(host, "connected")
    except OSError as exc:
        print(host, type(exc).__name__)
"""


def test_machines_have_their_own_names_addresses_and_loopback(two):
    m0, m1 = two.machines
    for me, other in ((m0, m1), (m1, m0)):
        script = f"hostname; getent hosts {me.hostname} {other.hostname}; ip -o -4 addr show dev eth0"
        seen = me.run(["sh", "-c", script], timeout=HANG_S)
        assert seen.returncode == 0, seen.stderr
        lines = seen.stdout.splitlines()
        assert lines[0] == me.hostname
        assert lines[1].split() == ["127.0.1.1", me.hostname]  # Debian's layout
        assert lines[2].split() == [other.address, other.hostname]
        assert f"inet {me.address}/24" in lines[3]
    # machine1 reaches machine0's address, but its own loopback is not machine0's
    listener = two.run({m0: _python(LISTEN)})
    server = listener.processes[0]
    _wait_for(server.stdout_path, "listening", server.popen)
    probe = m1.run(_python(CONNECT) + ["127.0.0.1", m0.address], timeout=HANG_S)
    assert probe.stdout.split("\n")[:2] == ["127.0.0.1 ConnectionRefusedError", f"{m0.address} connected"], (
        probe.stdout + probe.stderr
    )
    listener.wait(timeout=HANG_S)
    assert listener.returncodes() == [0] and f"accepted {m1.address}" in server.stdout()


def test_namespaces_go_away_on_failure_and_stale_ones_are_swept(can_build_machines):
    # a dead run's leftovers (its pid is gone) are swept; a live run's are not
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, live = f"{_machines.PREFIX}{dead.pid}-0-m0", f"{_machines.PREFIX}{os.getpid()}-keep-m0"
    for name in (stale, live):
        subprocess.run(["ip", "netns", "add", name], check=True, timeout=HANG_S)
    (Path("/etc/netns") / stale).mkdir(parents=True, exist_ok=True)
    try:
        made = []
        with pytest.raises(RuntimeError, match="the body failed"):
            with _machines.machines(2) as cluster:
                made = [m.netns for m in cluster.machines] + [cluster.switch]
                assert set(made) <= set(_machines._namespaces())
                raise RuntimeError("the body failed")
        left = set(_machines._namespaces())
        assert made and not (set(made) & left), left
        assert stale not in left and not (Path("/etc/netns") / stale).exists()
        assert live in left
    finally:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=HANG_S)


CHOOSE = """
import os
from rpc_backend.network import choose_network
print(choose_network(os.environ))
"""


def test_each_machine_picks_its_own_interface(two):
    m0, m1 = two.machines
    # a master on another machine, named or by address; the master's machine by address
    for machine, master in ((m1, m0.hostname), (m1, m0.address), (m0, m0.address)):
        env = _machines.clean_env(MASTER_ADDR=master, MASTER_PORT=PORT)
        seen = machine.run(_python(CHOOSE), timeout=SETUP_S, env=env, cwd=_machines.ROOT)
        assert seen.returncode == 0, seen.stderr
        assert f"interface='eth0', address='{machine.address}'" in seen.stdout, (machine, master, seen.stdout)
    # the master's own name is loopback there: on a one-machine job, nothing changes
    env = _machines.clean_env(MASTER_ADDR=m0.hostname, MASTER_PORT=PORT)
    seen = m0.run(_python(CHOOSE), timeout=SETUP_S, env=env, cwd=_machines.ROOT)
    assert seen.stdout.strip() == "None", seen.stdout + seen.stderr


def _static(cluster, host0: str, env: dict) -> _machines.Job:
    m0, m1 = cluster.machines
    first, second = COMMANDS[1:]  # the guide's two-machine pair, --node-rank=0 then 1
    assert "--node-rank=0" in first and "--node-rank=1" in second
    return cluster.run({m0: _argv(first, HOST0=host0, PORT=PORT), m1: _argv(second, HOST0=host0, PORT=PORT)},
                       env=env).wait(JOB_S)


@pytest.mark.parametrize("host0", ["hostname", "address"])
def test_guide_static_two_machines_without_variables(two, host0):
    m0 = two.machines[0]
    job = _static(two, m0.hostname if host0 == "hostname" else m0.address, _machines.clean_env())
    assert job.returncodes() == [0, 0], job.report()
    _check(job.stdout(), trainers=3)
    # ps0 and trainer0 on the first machine, trainer1 and trainer2 on the second
    first, second = (p.stdout() for p in job.processes)
    assert "ps0: serving" in first and "trainer0: loss" in first, job.report()
    assert "trainer1: loss" in second and "trainer2: loss" in second, job.report()


def test_guide_static_fails_with_the_variables_on_loopback(two):
    # the failure of issue 42, kept reproducible: ranks that advertise loopback cannot reach
    # each other across machines (which also shows these machines share no loopback), and
    # explicit variables win over the interface rpc_backend would pick
    env = _machines.clean_env(TP_SOCKET_IFNAME="lo", GLOO_SOCKET_IFNAME="lo")
    job = _static(two, two.machines[0].address, env)
    assert any(code not in (0, None) for code in job.returncodes()), job.report()
    assert not any(p.stopped.startswith("stopped by the harness: still running") for p in job.processes), job.report()
    stderr = "".join(p.stderr() for p in job.processes)
    assert re.search(r"\[127\.0\.[01]\.1\]", stderr), job.report()  # Gloo names the loopback address it tried


def test_c10d_two_machines_without_variables(two):
    # the guide's c10d form (tutorials/torchrun.md, several machines) with the walkthrough's job:
    # torchrun sets MASTER_ADDR to the hostname of the machine that got group rank 0, which
    # that machine's hosts file puts on 127.0.1.1
    command = DLRM_COMMANDS[1].replace("-m remote_module.demos.dlrm --servers 2", "tutorials/torchrun_job.py")
    argv = _argv(command, HOST0=two.machines[0].hostname, PORT=PORT)
    job = two.run({m: argv for m in two.machines}, env=_machines.clean_env()).wait(JOB_S)
    assert job.returncodes() == [0, 0], job.report()
    _check(job.stdout(), trainers=3)


def test_guide_dlrm_on_two_machines_without_variables(two, tmp_path):
    # the guide's command as written (a short run): 2 servers, 2 trainers, one summary
    argv = _argv(f"{DLRM_COMMANDS[1]} --steps 20", HOST0=two.machines[0].hostname, PORT=PORT)
    job = two.run({m: argv for m in two.machines}, env=_machines.clean_env(), cwd=tmp_path).wait(JOB_S)
    assert job.returncodes() == [0, 0], job.report()
    out = job.stdout()
    assert out.count("DLRM click model: 2 parameter servers, 2 trainers") == 1, job.report()
    rows = [line.split() for line in out.splitlines() if re.match(r"trainer\d ", line)]
    assert [row[0] for row in rows] == ["trainer0", "trainer1"], job.report()
    for row in rows:
        assert float(row[3]) < float(row[1]), row  # the loss fell
