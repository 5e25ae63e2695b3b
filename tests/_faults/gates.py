"""Host-side gates: a call that blocks until the test releases it (instead of sleeping), and
calls that record when they ran on their host. Module level: RPC runs them by reference.

    hold(key)       on a host: blocks until release(key) (at most ``limit`` seconds)
    release(key)    on the same host: lets it return
    holding(key)    True while a hold(key) is blocked there
    release_at_shutdown(key)  on a host: release(key) once every worker is in rpc.shutdown()
"""

from __future__ import annotations

import functools
import threading
import time
import weakref

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from tests.proxy._remote import UserError

_lock = threading.Lock()
_released: dict[str, threading.Event] = {}
_holding: set[str] = set()


def _event(key: str) -> threading.Event:
    with _lock:
        return _released.setdefault(key, threading.Event())


def hold(key: str, limit: float = 30.0) -> str:
    """Block until :func:`release` (or ``limit`` seconds: a test that forgot never hangs a host)."""
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


def fails_while_held(call, key: str, expected: type[BaseException], within: float, worker: str = "worker1"):
    """Caller side: run ``call(key)`` against ``worker``, whose ``hold(key)`` keeps it waiting;
    return the ``expected`` error it raised, checking it came within ``within`` seconds. The
    hold is released whatever happens."""
    import pytest

    start = time.monotonic()
    try:
        with pytest.raises(expected) as info:
            call(key)
        elapsed = time.monotonic() - start
    finally:
        rpc.rpc_sync(worker, release, (key,))
    assert elapsed < within, elapsed
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
        _held_instances[key] = self
        _held_built.add(key)


def held_instance(key: str) -> str:
    """``"pending"`` (not built yet), ``"alive"`` or ``"gone"`` (built, then freed)."""
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
