"""Rank functions for tests/backend/test_watch_worlds.py (run by run_local on every rank)."""

from __future__ import annotations

import os
import signal
import threading
import time

import torch.distributed.rpc as rpc

from rpc_backend import current_worker, lost_workers
from rpc_backend.watch import current_watcher
from tests._deadlines import HANG_S


def _wait_until(predicate, what: str) -> None:
    """Poll ``predicate`` (in Python, so that a signal reaches this thread) for at most HANG_S."""
    deadline = time.monotonic() + HANG_S
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {HANG_S} s")
        time.sleep(0.05)


def _freeze_once_known() -> None:
    """Stop this process (SIGSTOP: alive, but silent) once every peer has heard from it."""
    me = current_worker()
    _wait_until(lambda: len(current_watcher().known_to()) == me.world_size - 1, "not every peer heard from it")
    os.kill(os.getpid(), signal.SIGSTOP)


def freeze_the_last_rank() -> None:
    """The last rank stops itself; the others wait in Python until their heartbeats end them."""
    me = current_worker()
    if me.rank == me.world_size - 1:
        _freeze_once_known()
    _wait_until(lambda: False, "the frozen rank was not found lost")


def _echo(x: int) -> int:
    return x


def call_a_frozen_rank() -> None:
    """worker1 stops itself; worker0 calls it until a call waits (in C++, which no signal
    interrupts) with a timeout longer than the test lasts: only the exit after the grace ends it."""
    me = current_worker()
    if me.rank == 1:
        _freeze_once_known()
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        rpc.rpc_sync("worker1", _echo, (1,), timeout=HANG_S)


def lose_the_replica() -> object:
    """replica0 kills itself (SIGKILL); trainer0 goes on until its heartbeats name it lost,
    then returns; ps0 only serves."""
    return _stop_the_replica(signal.SIGKILL)


def freeze_the_replica() -> object:
    """As :func:`lose_the_replica`, but replica0 stops itself (SIGSTOP): it never exits by
    itself, so the launcher must end it once the heartbeats count it lost."""
    return _stop_the_replica(signal.SIGSTOP)


def _stop_the_replica(signum: int) -> object:
    me = current_worker()
    if me.role == "replica":
        os.kill(os.getpid(), signum)
    if me.role == "trainer":
        _wait_until(lambda: bool(lost_workers()), "the replica was not found lost")
        return [w.name for w in lost_workers()]
    return "served"


_RELEASE = threading.Event()
#: calls worker0 sends worker1, each holding one of its RPC threads (16 by default) until
#: released: the rest wait in its queue, heartbeats from worker0 and answers to its own behind them
BACKLOG = 64


def _busy() -> int:
    _RELEASE.wait(HANG_S)
    return 1


def a_backlog_is_not_silence() -> object:
    """worker0 fills worker1's RPC threads and queue with calls that wait until worker1's
    main thread releases them; worker1 releases them once nothing has been heard from worker0
    for twice ``lost_after`` (heartbeats that wait in worker1's queue): before rpc_backend
    probed its own queue, worker1 then named the healthy worker0 lost. Every call is answered."""
    me = current_worker()
    if me.rank == 0:
        futures = [rpc.rpc_async("worker1", _busy, timeout=HANG_S) for _ in range(BACKLOG)]
        return sum(f.wait() for f in futures)
    watcher = current_watcher()
    after = watcher.settings.lost_after
    peer = watcher.peers.peers["worker0"]
    _wait_until(lambda: time.monotonic() - peer.last_heard > 2 * after, "worker0 silent behind the backlog")
    lag = time.monotonic() - watcher.peers.caught_up  # this rank's own queue, as far behind
    _RELEASE.set()
    return {"lost": [w.name for w in lost_workers()], "lag_over_lost_after": lag > after}
