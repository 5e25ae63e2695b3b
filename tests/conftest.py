"""One RPC world for the whole test session.

The pytest process is rank 0 (``worker0``); helper ranks are spawned once, as plain
subprocesses that only serve (tests/_helper_worker.py). The rendezvous is a fresh
``file://`` path chosen here, everything listens on loopback, and the helpers are reaped at
the end (they also exit by themselves if this process dies). Tests that must kill or restart
workers build their own small world instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._deadlines import HANG_S, SETUP_S
from tests._transport import world_options

# One intra-op thread per process, here and in every rank the tests start (they inherit it),
# unless the caller chose otherwise: the tests run many processes on few cores, and OpenMP's
# threads wait busily after each parallel op, taking the cores the other ranks' RPCs need.
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parent.parent
#: the session world's rpc_timeout while it starts (torch's rendezvous and first all-gather use
#: it), then the default deadline of calls made without one: both must outlast a loaded
#: machine (tests/_deadlines.py); every call whose failure a test expects gives its own timeout
RPC_TIMEOUT = SETUP_S
CALL_TIMEOUT = HANG_S
#: rank -> name. ``bare`` is reserved for the test that checks a host nothing was run on.
WORLD = ("worker0", "worker1", "worker2", "bare")


class World:
    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.me = names[0]


@pytest.fixture(scope="session")
def rpc_world():
    import torch.distributed.rpc as rpc

    from rpc_backend import shutdown_rpc
    from rpc_backend.loopback import fresh_file_rendezvous, loopback_env

    os.environ.update(loopback_env())
    init_method, path = fresh_file_rendezvous()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    helpers = [
        subprocess.Popen(
            [sys.executable, "-m", "tests._helper_worker", name, str(rank), str(len(WORLD)), init_method,
             str(RPC_TIMEOUT), str(os.getpid()), str(CALL_TIMEOUT)],
            cwd=ROOT,
            env=env,
        )
        for rank, name in enumerate(WORLD)
        if rank > 0
    ]
    try:
        options = world_options(
            init_method=init_method, rpc_timeout=RPC_TIMEOUT, num_worker_threads=16
        )
        rpc.init_rpc(WORLD[0], rank=0, world_size=len(WORLD), rpc_backend_options=options)
        rpc._set_rpc_timeout(CALL_TIMEOUT)
        yield World(WORLD)
        # graceful, but never a hung session: raises (fails loudly) if not done within HANG_S
        shutdown_rpc(graceful=True, timeout=HANG_S)
    finally:
        for p in helpers:
            try:
                p.wait(timeout=HANG_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if os.path.exists(path):
            os.unlink(path)


@pytest.fixture(scope="session")
def ps_world():
    """One parameter-server world (driver, ps0-ps2, trainer0-trainer2) for the PS tests that
    kill nothing (tests/ps/test_dense.py, tests/ps/test_embedding.py): started once per pytest process,
    when the first of them needs it (each start costs every rank's ``import torch``)."""
    from tests.ps._world import PSWorld

    with PSWorld({"ps": 3, "trainer": 3}) as w:
        yield w


#: pytest's per-test timeouts (the default in pyproject.toml and every ``@pytest.mark.timeout``)
#: are guards against hangs, not time limits: on a loaded machine (load ~20 on 2 cores) a test
#: that starts processes takes several times its quiet time, so every limit is stretched by
#: this factor (``REMOTE_MODULE_TEST_TIMEOUT_SCALE``, default 3).
TIMEOUT_SCALE = float(os.environ.get("REMOTE_MODULE_TEST_TIMEOUT_SCALE", "3"))


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "timeout", None):
        config.option.timeout = float(config.option.timeout) * TIMEOUT_SCALE


#: The files that start many processes (subprocess worlds, torchrun, benchmark smoke runs), in
#: falling order of their wall time on a 2-core machine. With several pytest processes
#: (pytest-xdist, ``--dist loadfile``: a file stays in one process, so its worlds are started
#: once; see the Makefile), handing these out first keeps one long file from being the last
#: thing left running. Only the order changes: every file still runs, the rest in collection
#: order. (Not ``--dist loadgroup``: pytest-xdist 3.8 marks a group in ``item._nodeid``, which
#: pytest 9.2 no longer reads, so every test became a group of its own.)
RUN_FIRST = (
    "tests/test_tutorials.py",
    "tests/test_torchrun.py",
    "tests/benchmarks/test_smoke.py",
    "tests/test_packaging.py",
    "tests/pipeline/test_faults.py",
    "tests/proxy/test_contract_faults.py",
    "tests/sharded/test_faults.py",
    "tests/ps/test_dense_edge_cases.py",
    "tests/ps/test_embedding_faults.py",
    "tests/ps/test_shard_checkpoints.py",
    "tests/backend/test_shutdown.py",
    "tests/backend/test_worlds.py",
    "tests/proxy/test_same_script.py",
    "tests/ps/test_dense.py",
    "tests/backend/test_launcher.py",
    "tests/proxy/test_shipping.py",
    "tests/backend/test_lifetime.py",
)


def _file_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def _file_order(item: pytest.Item) -> int:
    path = _file_of(item)
    return RUN_FIRST.index(path) if path in RUN_FIRST else len(RUN_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # only when pytest-xdist distributes (-n N): in its workers, whose collection order is the
    # order the controller hands the files out in
    if getattr(config.option, "numprocesses", None) or hasattr(config, "workerinput"):
        items.sort(key=_file_order)  # stable: within a file, and among the other files, nothing moves
    for item in items:
        marker = item.get_closest_marker("timeout")
        if marker is not None and marker.args:
            item.add_marker(pytest.mark.timeout(float(marker.args[0]) * TIMEOUT_SCALE), append=False)


# ---- simulated machines (tests/_machines.py): for tests/test_machines*.py, test_lost_machines.py


@pytest.fixture(scope="module")
def can_build_machines():
    """Skips the test, with the reason, where network namespaces cannot be made (not root, no
    ``ip``/``unshare``)."""
    from tests import _machines

    reason = _machines.missing_requirements()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def two(can_build_machines):
    """Two simulated machines, removed after the test."""
    from tests import _machines

    with _machines.machines(2) as cluster:
        yield cluster

