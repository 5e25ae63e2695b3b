"""Joining a torchrun job's world (rpc_backend/connect.py): the bound, the report, restarts.

Here without namespaces: the attempt protocol on a real store on loopback, the report as a pure
function, and two torchrun jobs on this machine (a restart after a killed trainer; a rank that
never arrives). The same cases across simulated machines are in tests/test_machines_connect.py.
"""

import re
import socket
import subprocess
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from rpc_backend import connect, loopback_store, make_options
from rpc_backend.connect import ConnectError, Endpoint, agree_on_world, explain, join_world, own_endpoint
from rpc_backend.options import CONNECT_TIMEOUT_VARIABLE, DEFAULT_CONNECT_TIMEOUT, connect_timeout
from tests._deadlines import HANG_S, SETUP_S
from tests.test_torchrun import _argv, _env

ROOT = Path(__file__).resolve().parents[2]
JOB = "tests/backend/scripts/attempts_job.py"
NAMES = ["ps0", "trainer0", "trainer1", "trainer2"]
TABLE = [("lo", "127.0.0.1"), ("eth0", "10.42.0.1")]


# -- the bound's setting --------------------------------------------------------------------------


def test_the_bound_comes_from_the_argument_the_variable_or_the_default():
    assert connect_timeout(env={}) == DEFAULT_CONNECT_TIMEOUT == 300.0
    assert connect_timeout(env={CONNECT_TIMEOUT_VARIABLE: " 45 "}) == 45.0
    assert connect_timeout(20, env={CONNECT_TIMEOUT_VARIABLE: "45"}) == 20.0
    for wrong in ("soon", "0", "-3", "inf"):
        with pytest.raises(ValueError, match=rf"{CONNECT_TIMEOUT_VARIABLE}='{re.escape(wrong)}' is not a number"):
            connect_timeout(env={CONNECT_TIMEOUT_VARIABLE: wrong})
    with pytest.raises(ValueError, match="connect_timeout must be a positive number"):
        connect_timeout(0)


# -- one attempt's store prefix -------------------------------------------------------------------


def _client(store):
    """Another connection to ``store``'s server, as each rank's process has its own (a client
    blocked in a wait holds its connection)."""
    return dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=HANG_S))


def _agree_all(store, world_size, ranks, deadline_s=HANG_S):
    """Run agree_on_world for ``ranks`` on threads, each with its own client of ``store``; their
    generations (or exceptions) by rank."""
    results = {}
    clients = {rank: _client(store) for rank in ranks}

    def one(rank):
        try:
            results[rank] = agree_on_world(clients[rank], rank, world_size, time.monotonic() + deadline_s)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            results[rank] = exc

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    return threads, results


def test_each_attempt_agrees_on_a_fresh_generation_even_when_rank_0_comes_last():
    store = loopback_store(timeout=HANG_S)
    threads, first = _agree_all(store, 3, [0, 1, 2])
    for t in threads:
        t.join(HANG_S)
    assert first == {0: 1, 1: 1, 2: 1}
    # the next attempt (fresh processes, the same store): ranks 1 and 2 arrive before rank 0,
    # while the dead attempt's generation and welcomes are still in the store
    stale = {r: store.get(connect.HELLO_KEY.format(rank=r)) for r in (1, 2)}
    late, second = _agree_all(store, 3, [1, 2])
    for r in (1, 2):
        deadline = time.monotonic() + HANG_S
        while store.get(connect.HELLO_KEY.format(rank=r)) == stale[r]:
            assert time.monotonic() < deadline, f"rank {r} posted no new nonce"
            late[0].join(0.05)
    assert not second, second  # nobody took the dead attempt's generation
    early, zero = _agree_all(store, 3, [0])
    for t in late + early:
        t.join(HANG_S)
    assert {**second, **zero} == {0: 2, 1: 2, 2: 2}


def test_rank_0_names_the_ranks_that_never_arrived():
    store = loopback_store(timeout=HANG_S)
    with pytest.raises(connect._Waiting, match=r"rank\(s\) 1, 2 never arrived"):
        agree_on_world(store, 0, 3, time.monotonic() + 0.5)


def test_a_rank_without_rank_0_says_so():
    store = loopback_store(timeout=HANG_S)
    with pytest.raises(connect._Waiting, match="rank 0 never welcomed this rank"):
        agree_on_world(store, 2, 3, time.monotonic() + 0.5)


def test_a_join_whose_store_never_answers_fails_within_the_bound_saying_so(monkeypatch):
    # nothing listens on the port: the join fails at its bound (1 s; torch's store client
    # would retry for its own timeout) and says which store it tried. This pytest process may
    # already hold the session's RPC world (tests/conftest.py's rpc_world, when an earlier file
    # in it asked for one): the refusal to join a second world, checked first, is tested below
    monkeypatch.setattr(connect, "is_rpc_initialized", lambda: False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConnectError) as failed:
        join_world("trainer0", 1, 2, ["ps0", "trainer0"], ("127.0.0.1", port), make_options(), agent_store=True,
                   timeout=1, env={})
    text = str(failed.value)
    assert text.startswith(f"rank 1 (trainer0) on {socket.gethostname()} could not join the RPC world: still "
                           f"connecting to the job's store at 127.0.0.1:{port} after "), text
    assert "(the bound: connect_timeout or RPC_BACKEND_CONNECT_TIMEOUT=1 s)" in text
    assert f"To fix: the job's store at 127.0.0.1:{port} does not answer" in text


# -- the report -----------------------------------------------------------------------------------


def _ep(rank, host, interface, address, how="chosen by rpc_backend"):
    return Endpoint(rank, NAMES[rank], host, interface, address, how)


def _explain(me, peers, error=None, phase="connecting to the other ranks", spans=False):
    return explain(what="the RPC world", me=me, rank=me.rank, names=NAMES, phase=phase, error=error,
                   elapsed=31.0, bound=30.0, bound_name="connect_timeout or RPC_BACKEND_CONNECT_TIMEOUT",
                   peers=peers, store="10.42.0.1:29400", spans=spans, table=TABLE)


def test_the_report_names_a_peer_that_advertises_loopback_from_another_machine():
    me = _ep(0, "machine0", "eth0", "10.42.0.1")
    peers = {1: _ep(1, "machine0", "eth0", "10.42.0.1"), 2: _ep(2, "machine1", "lo", "127.0.0.1", "set"),
             3: _ep(3, "machine1", "lo", "127.0.0.1", "set")}
    text = _explain(me, peers)
    assert text.startswith("rank 0 (ps0) on machine0 could not join the RPC world: still connecting to the other "
                           "ranks after 31 s (the bound: connect_timeout or RPC_BACKEND_CONNECT_TIMEOUT=30 s)")
    assert "This rank listens on 10.42.0.1 (eth0, chosen by rpc_backend)" in text
    assert "rank 2 (trainer1) on machine1 at 127.0.0.1 (lo)" in text  # the address it tried
    assert "set TP_SOCKET_IFNAME and GLOO_SOCKET_IFNAME on machine1" in text


def test_the_report_tells_a_rank_on_loopback_to_fix_its_own_machine():
    me = _ep(2, "machine1", "lo", "127.0.0.1", "TP_SOCKET_IFNAME set in the environment")
    peers = {0: _ep(0, "machine0", "eth0", "10.42.0.1"), 1: _ep(1, "machine0", "eth0", "10.42.0.1"),
             3: _ep(3, "machine1", "lo", "127.0.0.1")}
    error = RuntimeError("Gloo connectFullMesh failed with ... remote=[10.42.0.1]:4276\nmore")
    text = _explain(me, peers, error=error)
    assert "connecting to the other ranks failed after 31 s with RuntimeError: Gloo connectFullMesh failed with " \
           "... remote=[10.42.0.1]:4276." in text
    assert "this rank advertises 127.0.0.1 (lo, TP_SOCKET_IFNAME set in the environment)" in text
    assert "set TP_SOCKET_IFNAME and GLOO_SOCKET_IFNAME on machine1 to the interface of the network the " \
           "machines share (here: eth0 10.42.0.1)" in text


def test_the_report_names_ranks_that_never_arrived_and_the_bound():
    me = _ep(0, "machine0", "eth0", "10.42.0.1")
    text = _explain(me, {1: _ep(1, "machine0", "eth0", "10.42.0.1"), 2: connect.NO_ADDRESS_YET,
                         3: connect.NEVER_ARRIVED})
    assert "rank 2 (trainer1): arrived, but published no address yet" in text
    assert "rank 3 (trainer2): never arrived" in text
    assert "rank(s) 3 (trainer2) never arrived: each died" in text
    assert "raise the bound (RPC_BACKEND_CONNECT_TIMEOUT, now 30 s)" in text


def test_the_report_points_at_the_ports_when_every_address_looks_right():
    me = _ep(2, "machine1", "eth0", "10.42.0.2")
    peers = {0: _ep(0, "machine0", "eth0", "10.42.0.1"), 1: _ep(1, "machine0", "eth0", "10.42.0.1"),
             3: _ep(3, "machine1", "eth0", "10.42.0.2")}
    text = _explain(me, peers)
    assert "rank 0 (ps0) on machine0 at 10.42.0.1 (eth0)" in text
    assert "reach each other on every TCP port, not only MASTER_PORT" in text


def test_the_report_says_when_the_jobs_store_is_gone():
    text = _explain(_ep(2, "machine1", "eth0", "10.42.0.2"), None)
    assert "unknown (the job's store at 10.42.0.1:29400 does not answer)" in text
    assert "that torchrun has exited" in text
    # still telling a rank on loopback in a job across machines to fix its own machine
    me = _ep(2, "machine1", "lo", "127.0.0.1", "TP_SOCKET_IFNAME set in the environment")
    assert "set TP_SOCKET_IFNAME and GLOO_SOCKET_IFNAME on machine1" not in _explain(me, None)
    text = _explain(me, None, spans=True)
    assert "that torchrun has exited" in text
    assert "a loopback address that ranks on other machines cannot reach: set TP_SOCKET_IFNAME and " \
           "GLOO_SOCKET_IFNAME on machine1" in text


def test_own_endpoint_reads_the_interface_variable():
    env = {"TP_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0"}
    me = own_endpoint(1, "trainer0", env, table=TABLE + [("eth0", "fd00::1")])
    assert (me.interface, me.address, me.how) == ("eth0", "10.42.0.1", "TP_SOCKET_IFNAME set in the environment")
    assert Endpoint.decode(me.encode()) == me
    unset = own_endpoint(1, "trainer0", {}, table=TABLE)
    assert "neither TP_SOCKET_IFNAME nor GLOO_SOCKET_IFNAME" in unset.how


# -- torchrun on this machine ---------------------------------------------------------------------


def _torchrun(command: str, timeout: float, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(_argv(command), cwd=ROOT, env={**_env(), **env}, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(SETUP_S + HANG_S)
def test_a_restart_after_a_killed_trainer_forms_a_new_world():
    # trainer1 (rank 2) kills itself after the first step; torchrun restarts the three workers,
    # whose world forms again (before rpc_backend/connect.py, the new ranks read the dead
    # attempt's addresses from torchrun's store and the job hung)
    done = _torchrun(f"torchrun --standalone --nproc-per-node=3 --max-restarts=1 {JOB}", SETUP_S + HANG_S / 2,
                     ATTEMPTS_JOB_DIE="2:after_init")
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert "rank 2: killing itself (after_init)" in done.stdout
    finished = re.findall(r"^(\w+): attempt (\d) done in ([\w/]+)", done.stdout, re.M)
    assert sorted(name for name, _, _ in finished) == ["ps0", "trainer0", "trainer1"], done.stdout
    assert {(attempt, world) for _, attempt, world in finished} == {("1", "rpc_backend/world2")}, done.stdout


@pytest.mark.slow
@pytest.mark.timeout(SETUP_S + HANG_S)
def test_a_rank_that_never_arrives_fails_the_others_within_the_bound_by_name():
    # trainer0 (rank 1) hangs before init_from_env: the others fail within their bound, naming
    # it; torchrun then stops it and the job exits non-zero by itself
    done = _torchrun(f"torchrun --standalone --nproc-per-node=3 {JOB}", SETUP_S + HANG_S / 2,
                     ATTEMPTS_JOB_DIE="1:hang_before_init", RPC_BACKEND_CONNECT_TIMEOUT="5")
    assert done.returncode != 0, done.stdout + done.stderr[-4000:]
    errors = re.findall(r"ConnectError: (rank \d \(\w+\) on .*)", done.stderr)
    assert errors, done.stderr[-4000:]
    for text in errors:
        assert "rank(s) 1 never arrived" in text or "rank(s) 1 (trainer0) never arrived" in text, text
        assert "the bound: connect_timeout or RPC_BACKEND_CONNECT_TIMEOUT=5 s" in text, text


def test_joining_while_in_a_world_is_refused_before_the_store(monkeypatch):
    # (not a network failure: no ConnectError with network advice, and nothing written to the
    # job's store, whose generation counter the other ranks agree on)
    monkeypatch.setattr(connect, "is_rpc_initialized", lambda: True)
    with pytest.raises(RuntimeError, match=r"already in an RPC world: shut it down") as raised:
        names = ["ps0", "trainer0"]
        join_world("trainer0", 1, 2, names, ("127.0.0.1", 9), make_options(worker_names=names),
                   agent_store=True, timeout=1.0, env={})
    assert not isinstance(raised.value, ConnectError)
