"""Calls that a host keeps waiting until the test lets them go, for the tests of timeouts and
of calls running at the same time in tests/proxy and tests/core, and the caller-side check of
a timeout that holds at any speed.

Host side (module level: RPC runs these by reference). Every hold ends when the test calls
``gates.release(key)`` on that host, or after HANG_S (a test that forgot never keeps a host
thread for good); ``gates.holding(key)`` tells whether one is waiting now:

    hold(key)                  blocks; returns ``key``
    Held                       ``forward(key)``: holds keys that start with "hold", returns ``key``
    timed(tag, key)            holds; ``(tag, host name, start, end)``, see :func:`finished`
    HeldInit(key)              its construction holds; :func:`held_instance` reports on it
    TogetherInit(tag, key)     its construction holds; ``forward`` says when that ran
    Crowd                      ``forward(seconds, crowd)``: waits until ``crowd`` calls are inside

Caller side: :func:`fails_while_held`.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import torch
from torch import nn

from tests._deadlines import HANG_S
from tests._faults import gates

#: block until ``gates.release(key)`` here (HANG_S at most)
hold = gates.hold


class Held(nn.Module):
    """``forward(key)``: holds keys that start with "hold" until released; returns ``key``."""

    def forward(self, key: str) -> str:
        if key.startswith("hold"):
            hold(key)
        return key


def timed(tag: int, key: str | None = None) -> tuple[int, str, float, float]:
    """Hold on ``key`` (if given); ``(tag, host name, start, end)`` in wall-clock seconds
    (:func:`gates.timed` without its sleep; :func:`finished` lists the tags that returned)."""
    return gates.timed(tag, 0.0, key)


finished = gates.finished
HeldInit = gates.HeldInit
held_instance = gates.held_instance


class TogetherInit(nn.Module):
    """Construction holds on ``key``; ``forward(x)`` returns ``(tag, started, ended, x * tag)``:
    when the constructor began and ended (wall-clock seconds on the host)."""

    def __init__(self, tag: int, key: str) -> None:
        super().__init__()
        self.started = time.time()
        hold(key)
        self.ended = time.time()
        self.tag = tag

    def forward(self, x: torch.Tensor) -> tuple[int, float, float, torch.Tensor]:
        return self.tag, self.started, self.ended, x * self.tag


class Crowd(nn.Module):
    """``forward(seconds, crowd=0)``: sleeps ``seconds`` (a call that costs the host that much:
    a channel sends such calls one message each), then, when ``crowd`` > 0, waits until
    ``crowd`` such calls are waiting at once, and from then on lets every call through. Calls
    run one after another never get there: the first one raises after HANG_S (the test's hang
    guard). Returns ``seconds``; :meth:`most_inside` tells the most calls that waited at once."""

    def __init__(self) -> None:
        super().__init__()
        self._changed = threading.Condition()
        self._inside = 0
        self._most = 0
        self._open = False

    def forward(self, seconds: float, crowd: int = 0) -> float:
        time.sleep(seconds)
        if not crowd:
            return seconds
        with self._changed:
            self._inside += 1
            self._most = max(self._most, self._inside)
            if self._inside >= crowd:
                self._open = True
                self._changed.notify_all()
            try:
                if not self._changed.wait_for(lambda: self._open, HANG_S):
                    raise RuntimeError(f"hang guard ({HANG_S:g} s): at most {self._most} of {crowd} calls were "
                                       "ever inside at once")
            finally:
                self._inside -= 1
        return seconds

    def most_inside(self) -> int:
        with self._changed:
            return self._most


# ---- caller side -------------------------------------------------------------------------------


def wait_until(predicate: Callable[[], Any], what: str, seconds: float = HANG_S) -> None:
    """Poll ``predicate`` until it is true; fail the test (hang guard) after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"hang guard ({seconds:g} s): {what} never happened"
        time.sleep(0.01)


def fails_while_held(call: Callable[[str], Any], key: str, expected: type[BaseException], timeout: float,
                     worker: str = "worker1") -> BaseException:
    """Run ``call(key)``, a call with ``timeout`` whose host ``worker`` holds it on ``key``;
    return the ``expected`` error it raised. The hold is released only once the error is in
    (whatever happens), so no answer from the host can have ended the call. Checked at any
    speed: the error came no earlier than ``timeout`` (less one watcher tick), the call was
    still held on its host then (it reached the hold, and the hold had not ended), and it came
    within ``timeout`` + HANG_S (the hang guard)."""
    import pytest
    import torch.distributed.rpc as rpc

    from remote_module._core.settling import WATCH_TICK_S  # a deadline may fire a tick early

    start = time.monotonic()
    try:
        with pytest.raises(expected) as info:
            call(key)
        elapsed = time.monotonic() - start
        # nothing released it: if the hold is (still) waiting, the host has not answered yet
        wait_until(lambda: rpc.rpc_sync(worker, gates.holding, (key,)), f"the call held on {key!r} waiting on {worker}")
    finally:
        rpc.rpc_sync(worker, gates.release, (key,))
    assert elapsed >= timeout - WATCH_TICK_S, f"failed {elapsed:.3f} s after it was made, before its {timeout:g} s"
    assert elapsed < timeout + HANG_S, f"hang guard: the call failed only after {elapsed:.1f} s"
    return info.value
