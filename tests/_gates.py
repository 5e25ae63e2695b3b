"""Host-side gates: a call that blocks until the test releases it (instead of sleeping), and
calls that record when they ran on their host. Module level: RPC runs them by reference.

    hold(key)       on a host: blocks until release(key) (at most ``limit`` seconds)
    release(key)    on the same host: lets it return
    holding(key)    True while a hold(key) is blocked there
"""

from __future__ import annotations

import threading
import time

from torch.futures import Future
import torch.distributed.rpc as rpc

from tests._remote import UserError

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


def holding(key: str) -> bool:
    with _lock:
        return key in _holding


def timed(tag: int, seconds: float) -> tuple[int, str, float, float]:
    """Sleep ``seconds`` on the host; ``(tag, host name, start, end)`` in wall-clock seconds."""
    start = time.time()
    time.sleep(seconds)
    return tag, rpc.get_worker_info().name, start, time.time()


def fail(message: str) -> None:
    raise UserError(message)


def exit_now() -> None:
    raise SystemExit(3)


def tensor_rref(n: int) -> rpc.RRef:
    """An RRef owned by this host."""
    import torch

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
