"""Coalescing ``forward_async`` calls: many calls in flight share few RPC messages.

Each RPC message costs far more than the module call it carries (on this kind of machine a
no-op round trip is ~200 µs, a small ``Linear`` ~10 µs). A proxy's pipeline sends a call at
once while fewer than ``MAX_IN_FLIGHT`` messages are in flight, and otherwise queues it;
when a message returns, everything queued leaves as one message. A lone call is never
delayed; a burst of calls costs a few messages instead of one each.

Calls that take long on the host (over ``HEAVY_CALL_S`` on average) are not coalesced, so a
many-core host can still run them in parallel. Used only on the fast path (no distributed autograd context, no device map) and only for
calls whose arguments pickle on their own with every tensor inlined: each call is pickled
when it is made, so later changes to its arguments cannot leak in, and a call that cannot be
pickled fails alone, at once. Calls in one message run one after another on the host, in
the order they were made; each gets its own result or exception.
"""

from __future__ import annotations

import pickle
import threading
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from remote_module import _call_handlers
from remote_module._walk import map_tensors
from remote_module._inline import pack

MAX_IN_FLIGHT = 2
#: At most this many calls share one message.
MAX_BATCH = 32
#: Calls slower than this on the host are not coalesced: one message each lets a many-core
#: host run them in parallel (torch releases the GIL in heavy ops). Every PROBE_EVERY-th call
#: still takes the pipeline, to notice when calls become cheap again.
HEAVY_CALL_S = 0.001
PROBE_EVERY = 64


class Pipeline:
    """One per proxy and process (never pickled)."""

    def __init__(self, proxy: Any) -> None:
        self.proxy = proxy
        self.lock = threading.Lock()
        self.queue: list[tuple[bytes, bool, Future]] = []
        self.in_flight = 0
        self.calls_sent = 0  # statistics: calls and messages that left through the pipeline
        self.messages_sent = 0
        self.call_seconds = 0.0  # running average of the host's time per call
        self.skipped = 0

    def try_submit(self, args: tuple, kwargs: dict) -> Future | None:
        """Queue or send the call; None when it is not eligible (use the direct path)."""
        if self.call_seconds > HEAVY_CALL_S:
            self.skipped += 1
            if self.skipped % PROBE_EVERY:
                return None
        args, kwargs = pack(args), pack(kwargs)
        if _holds_tensors(args) or _holds_tensors(kwargs):
            return None  # a big tensor: it should travel through the tensor channel
        try:
            payload = pickle.dumps((args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            return None  # e.g. an RRef argument; the direct path sends it or names the culprit
        result = Future()
        call = (payload, torch.is_grad_enabled(), result)
        with self.lock:
            if self.in_flight >= MAX_IN_FLIGHT:
                self.queue.append(call)
                return result
            self.in_flight += 1
            self._count([call])
        self._send([call])
        return result

    def _send(self, batch: list[tuple[bytes, bool, Future]]) -> None:
        proxy = self.proxy
        message = ([(payload, grad) for payload, grad, _ in batch], proxy.module_key, proxy.device,
                   proxy.is_device_map_set)
        try:
            fut = rpc.rpc_async(proxy._dest(), _call_handlers._call_many, message, timeout=proxy.timeout)
        except Exception as exc:
            self._settle_all(batch, exc)
            self._next()
            return
        fut.add_done_callback(lambda done: self._done(done, batch))

    def _done(self, done: Any, batch: list[tuple[bytes, bool, Future]]) -> None:
        try:
            try:
                outs, seconds = done.wait()
            except BaseException as exc:
                self._settle_all(batch, exc)
                return
            self.call_seconds = 0.8 * self.call_seconds + 0.2 * (seconds / len(batch))
            for (_, _, result), out in zip(batch, outs):
                try:
                    self.proxy._settle(result, out, True)
                except BaseException as exc:  # never leave a caller waiting
                    if not result.done():
                        result.set_exception(exc)
        finally:
            self._next()  # whatever happened, the next batch goes

    def _settle_all(self, batch: list[tuple[bytes, bool, Future]], exc: BaseException) -> None:
        failure = self.proxy._async_failure(exc)
        for _, _, result in batch:
            result.set_exception(failure)

    def _next(self) -> None:
        with self.lock:
            batch, self.queue = self.queue[:MAX_BATCH], self.queue[MAX_BATCH:]
            if not batch:
                self.in_flight -= 1
                return
            self._count(batch)
        self._send(batch)

    def _count(self, batch: list) -> None:  # called with the lock held
        self.calls_sent += len(batch)
        self.messages_sent += 1


def _holds_tensors(obj: Any) -> bool:
    found: list[bool] = []
    map_tensors(lambda t: found.append(True) or t, obj)
    return bool(found)


def pipeline_of(proxy: Any) -> Pipeline:
    """The proxy's pipeline, made on first use in this process."""
    pipe = proxy.__dict__.get("_pipeline")
    if pipe is None:
        pipe = proxy.__dict__.setdefault("_pipeline", Pipeline(proxy))
    return pipe
