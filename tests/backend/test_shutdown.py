"""Graceful shutdown waits for every worker, however long they work; a number bounds it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

import rpc_backend.world as world
from rpc_backend import LocalWorldError, Worker, placements, run_local, shutdown_rpc
from rpc_backend._torch_private import UNBOUNDED_SHUTDOWN_TIMEOUT
from tests._deadlines import HANG_S, SETUP_S
from tests.backend import _ranks_remote

#: the bound the bounded case uses; rank 0 keeps calling well past bound + slack
BOUND = 1.0
SERVE_FOR = BOUND + world.SHUTDOWN_SLACK + 2.0
#: calls answered by worker1 in its shutdown, at least
MIN_CALLS = 11
#: a world that starts, then waits for something: SETUP_S, then a hang guard
WORLD = dict(timeout=SETUP_S + HANG_S, rpc_timeout=SETUP_S)


class _FakeRpc:
    """Stands in for torch.distributed.rpc: records how shutdown is called."""

    def __init__(self, graceful_takes: float) -> None:
        self.calls: list[dict] = []
        self.graceful_takes = graceful_takes
        self.done = threading.Event()
        #: an Event: a graceful shutdown waits for it (a gate the test opens) instead of sleeping
        self.held: threading.Event | None = None

    def shutdown(self, graceful: bool = True, timeout: float = -1.0) -> None:
        self.calls.append({"graceful": graceful, "timeout": timeout})
        if graceful:
            if self.held is not None:
                self.held.wait(HANG_S)  # a hang guard: the test opens it
            else:
                time.sleep(self.graceful_takes)
            self.done.set()


@pytest.fixture
def fake_rpc(monkeypatch):
    fake = _FakeRpc(graceful_takes=1.5)
    monkeypatch.setattr(world, "rpc", fake)
    monkeypatch.setattr(world, "is_rpc_initialized", lambda: not fake.done.is_set())
    monkeypatch.setattr(world, "SHUTDOWN_SLACK", 0.0)
    return fake


def test_unbounded_graceful_shutdown_waits_as_long_as_it_takes(fake_rpc):
    start = time.monotonic()
    shutdown_rpc(graceful=True)  # default: no bound
    assert time.monotonic() - start >= 1.5
    # torch's own "no timeout" value: any other number bounds each step of torch's shutdown
    assert fake_rpc.calls == [{"graceful": True, "timeout": UNBOUNDED_SHUTDOWN_TIMEOUT}]
    assert UNBOUNDED_SHUTDOWN_TIMEOUT == 0


def test_bounded_graceful_shutdown_gives_up_and_leaves_at_once(fake_rpc):
    fake_rpc.held = threading.Event()  # still running when the bound passes, however slow the machine
    try:
        with pytest.raises(RuntimeError, match=r"did not complete within 0.5 s .*Pass timeout=None"):
            shutdown_rpc(graceful=True, timeout=0.5)
    finally:
        fake_rpc.held.set()
    assert fake_rpc.calls == [{"graceful": True, "timeout": 0.5}, {"graceful": False, "timeout": -1.0}]


def test_worker_default_is_unbounded_and_a_bound_is_checked():
    layout = placements(2)
    assert Worker("worker0", 0, 2, 0, "worker", 0, 2, layout=layout).shutdown_timeout is None
    assert Worker("worker0", 0, 2, 0, "worker", 0, 2, shutdown_timeout=5, layout=layout).shutdown_timeout == 5.0
    with pytest.raises(ValueError, match=r"shutdown_timeout must be a positive number of seconds .* got inf"):
        Worker("worker0", 0, 2, 0, "worker", 0, 2, shutdown_timeout=float("inf"), layout=layout)
    with pytest.raises(ValueError, match="shutdown_timeout must be a positive number"):
        run_local(_ranks_remote.keep_calling_worker1, 2, shutdown_timeout=0)
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        shutdown_rpc(timeout=-1)


@pytest.mark.slow
def test_a_bounded_shutdown_drops_a_rank_the_others_still_use():
    # the old behaviour (then with a 60 s bound): worker1 returned at once, gives up waiting
    # after BOUND s and leaves while worker0 still calls it (worker0 calls until a call fails:
    # it is still calling when worker1 gives up, whatever the machine's speed). Were the bound
    # ignored, worker0 would call until its hang guard and the world end well.
    with pytest.raises(LocalWorldError) as info:
        run_local(_ranks_remote.keep_calling_worker1, 2, args=(None,), shutdown_timeout=BOUND, **WORLD)
    assert info.value.rank == 1
    assert f"did not complete within {BOUND} s" in str(info.value)


@pytest.mark.slow
def test_by_default_a_returned_rank_serves_until_the_others_are_done():
    # worker0 calls worker1 until worker1 has been in its graceful shutdown for SERVE_FOR s
    # (by worker1's own account) and has answered MIN_CALLS calls since
    out = run_local(_ranks_remote.keep_calling_worker1, 2, args=(SERVE_FOR, MIN_CALLS), **WORLD)
    assert out[1] is None
    assert out[0]["failure"] is None, out[0]
    assert out[0]["served"] >= SERVE_FOR, out[0]  # well past BOUND + slack: the bounded case failed by then
    assert out[0]["calls_since"] >= MIN_CALLS and out[0]["calls"] > 10, out[0]


def test_the_shared_test_world_shuts_down_through_rpc_backend():
    # one bounded-shutdown helper (rpc_backend.shutdown_rpc), not a private copy in conftest
    from tests import conftest

    source = Path(conftest.__file__).read_text()
    assert "shutdown_rpc(graceful=True, timeout=HANG_S)" in source
    assert "rpc.shutdown(" not in source and not hasattr(conftest, "_bounded_shutdown")
