"""Host-side gates: a call that blocks until the test releases it (instead of sleeping), and
calls that record when they ran on their host. Module level: RPC runs them by reference.

    hold(key)       on a host: blocks until release(key) (at most ``limit`` seconds, a hang
                    guard: tests/_deadlines.py's HANG_S by default)
    release(key)    on the same host: lets it return
    holding(key)    True while a hold(key) is blocked there
    release_at_shutdown(key)  on a host: release(key) once every worker is in rpc.shutdown()
    release_at_cancel(key)    on a host: release(key) once a pipeline's cancellation reached it

A key opens once: a test that holds twice uses a new key each time.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from tests._deadlines import HANG_S
from tests.proxy._remote import UserError

_lock = threading.Lock()
_released: dict[str, threading.Event] = {}
_holding: set[str] = set()


def _event(key: str) -> threading.Event:
    with _lock:
        return _released.setdefault(key, threading.Event())


def hold(key: str, limit: float = HANG_S) -> str:
    """Block until :func:`release` (or ``limit`` seconds: a test that forgot never hangs a host
    for good; generous, so that a slow machine never opens a gate before the test does)."""
    with _lock:
        _holding.add(key)
    try:
        _event(key).wait(limit)
    finally:
        with _lock:
            _holding.discard(key)
    return key


def release(key: str) -> None:
    _event(key).set()


def release_at_shutdown(key: str) -> None:
    """On a host that waits in a graceful ``rpc.shutdown()``: :func:`release` ``key`` when the
    shutdown's all-gather ends there (torch's leader broadcasts only once every worker, the
    caller included, has called ``rpc.shutdown()``). A call held on ``key`` is then still
    running when the caller's shutdown begins, however fast or slow the machine."""
    import torch.distributed.rpc.api as api

    original = api._broadcast_to_followers

    @functools.wraps(original)  # same name: still pickled by reference
    def broadcast(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        finally:
            release(key)

    api._broadcast_to_followers = broadcast


_at_cancel: dict[str, tuple[str, int] | None] = {}  # key -> the run whose cancellation opens it (None: any)


def release_at_cancel(key: str, caller: str | None = None, run: int | None = None) -> None:
    """On a pipeline stage's host: :func:`release` ``key`` once a cancellation has been
    recorded here (remote_module.pipeline._host._cancel: a forward's caller saw a micro-batch
    fail and cancels the rest), of run ``run`` of ``caller`` when given. A stage held on
    ``key`` then keeps the micro-batches queued behind it waiting until the caller has seen the
    failure, however fast or slow the machine."""
    from remote_module.pipeline import _host

    with _lock:
        _at_cancel[key] = None if run is None else (caller, run)
        if getattr(_host._cancel, "releases_gates", False):
            return
        original = _host._cancel

        @functools.wraps(original)  # same name: a caller still pickles it by reference
        def cancel(caller: str, run: int) -> None:
            try:
                original(caller, run)
            finally:
                with _lock:
                    opened = [k for k, which in _at_cancel.items() if which in (None, (caller, run))]
                    for k in opened:
                        del _at_cancel[k]
                for k in opened:
                    release(k)

        cancel.releases_gates = True
        _host._cancel = cancel


def fails_while_held(call, key: str, expected: type[BaseException], within: float = 0.0, worker: str = "worker1",
                     *, not_before: float | None = None):
    """Caller side: run ``call(key)`` against ``worker``, whose ``hold(key)`` keeps it waiting;
    return the ``expected`` error it raised. The hold is released only once the outcome is in
    (whatever it is), so no late answer from the host can have ended the call: the failure is
    the call's own, at any speed.

    ``within``: the call's timeout in seconds (0: none given); the failure must come before
    ``within + HANG_S``, a hang guard (tests/_deadlines.py), not a speed limit.
    ``not_before``: the failure must not come earlier than this many seconds (a lower bound
    holds on any machine: a call must not fail before its timeout)."""
    import pytest

    start = time.monotonic()
    try:
        with pytest.raises(expected) as info:
            call(key)
        elapsed = time.monotonic() - start
    finally:
        rpc.rpc_sync(worker, release, (key,), timeout=HANG_S)
    assert elapsed < within + HANG_S, f"hang guard: the call failed only after {elapsed:.1f} s"
    if not_before is not None:
        assert elapsed >= not_before, f"the call failed after {elapsed:.3f} s, before its {not_before:g} s"
    return info.value


def holding(key: str) -> bool:
    with _lock:
        return key in _holding


def timed(tag: int, seconds: float, key: str | None = None) -> tuple[int, str, float, float]:
    """Sleep ``seconds`` on the host (then :func:`hold` ``key``, if given); ``(tag, host name,
    start, end)`` in wall-clock seconds. :func:`finished` lists the tags that returned."""
    start = time.time()
    time.sleep(seconds)
    if key is not None:
        hold(key)
    end = time.time()
    with _lock:
        _finished.add(tag)
    return tag, rpc.get_worker_info().name, start, end


_finished: set[int] = set()


def finished(tags: list[int]) -> list[int]:
    """Those of ``tags`` whose :func:`timed` call returned on this host."""
    with _lock:
        return [t for t in tags if t in _finished]


def fail(message: str) -> None:
    raise UserError(message)


def exit_now() -> None:
    raise SystemExit(3)


def tensor_rref(n: int) -> rpc.RRef:
    """An RRef owned by this host."""
    return rpc.RRef(torch.full((n,), float(n)))


@rpc.functions.async_execution
def add_later(x: int, y: int) -> Future:
    fut: Future = Future()
    threading.Timer(0.05, lambda: fut.set_result(x + y)).start()
    return fut


@rpc.functions.async_execution
def fail_later(message: str) -> Future:
    fut: Future = Future()
    threading.Timer(0.05, lambda: fut.set_exception(UserError(message))).start()
    return fut


def attribute(obj: object, name: str) -> object:
    return getattr(obj, name)


def attribute_and_output(proxy, name: str, x):
    """On a third worker: a proxy's attribute as it arrived, and a call through it."""
    return getattr(proxy, name), proxy(x)


class SlowInit(torch.nn.Module):
    """Takes ``seconds`` to construct (then holds on ``key``, if given, until released) and
    reports, from forward, when its constructor ran."""

    def __init__(self, seconds: float, tag: int = 0, key: str | None = None) -> None:
        super().__init__()
        self.started = time.time()
        time.sleep(seconds)
        if key is not None:
            hold(key)
        self.ended = time.time()
        self.tag = tag

    def forward(self, x: torch.Tensor) -> tuple[int, float, float, torch.Tensor]:
        return self.tag, self.started, self.ended, x * self.tag


_held_instances: "weakref.WeakValueDictionary[str, HeldInit]" = weakref.WeakValueDictionary()
_held_built: set[str] = set()


class HeldInit(torch.nn.Module):
    """Construction blocks until ``release(key)``; :func:`held_instance` reports on it."""

    def __init__(self, key: str) -> None:
        super().__init__()
        hold(key)
        with _lock:
            _held_instances[key] = self
            _held_built.add(key)


def held_instance(key: str) -> str:
    """``"pending"`` (not built yet), ``"alive"`` or ``"gone"`` (built, then freed)."""
    with _lock:
        if key not in _held_built:
            return "pending"
        return "alive" if _held_instances.get(key) is not None else "gone"


class ExitsInInit(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        raise SystemExit(4)


def attribute_names(obj: object) -> list[str]:
    return sorted(vars(obj))


def unpicklable_result() -> threading.Lock:
    """An answer RPC cannot pickle (the call's failure, found on the host)."""
    return threading.Lock()
