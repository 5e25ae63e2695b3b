"""Host-side RPC handlers of ``forward`` calls: one call, or several that share a message.

Module-level so RPC pickles them by reference; the host imports this installed module on
first use and needs nothing else imported beforehand. Each call succeeds or fails alone: its
arguments are unpickled, the module runs and its output is pickled (``remote_module._proxy.wire``)
inside one ``try``, and anything raised, ``BaseException``s such as ``SystemExit``
included, becomes that call's own :class:`remote_module._core.errors.RemoteFailure`.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from remote_module._core import (
    capture,
    host_device,
    hosted_module,
    in_dist_autograd_context,
    prepare_inputs,
    prepare_output,
)
from remote_module._proxy import batching
from remote_module._proxy.batching import batcher_of
from remote_module._proxy.call_records import Answer, Call, Target
from remote_module._proxy.wire import dumps, loads

_clock = time.perf_counter


def _run_call(target: Target, call: Call) -> Any:
    """One call's result: its output as a Payload, or its RemoteFailure."""
    try:
        module = hosted_module(target.key)
        dev = host_device(target.device)
        args, kwargs = loads(call.payload)
        args, kwargs = prepare_inputs(args, kwargs, dev)
        if call.grad_enabled == torch.is_grad_enabled():
            out = module(*args, **kwargs)
        else:
            with torch.set_grad_enabled(call.grad_enabled):
                out = module(*args, **kwargs)
        out = prepare_output(out, dev, target.is_device_map_set)
        return dumps(out, inline=call.inline)
    except BaseException as exc:  # the call's own failure, whatever it is
        return capture(exc)


def forward_no_grad(key: Any, args: tuple, kwargs: dict) -> Any:
    """(A batcher's ``run``) the module held under ``key`` on arguments already on its device,
    under ``torch.no_grad()``."""
    module = hosted_module(key)
    with torch.no_grad():
        return module(*args, **kwargs)


def _joining(target: Target, call: Call, group: Any, start: float) -> Future | None:
    """The Future of a call's ``Answer`` (wire form) when it joins its module's batches
    (remote_module._proxy.batching); None when it runs alone: its module does not batch or is
    in training mode, it records (grad on, or a distributed autograd context on either side), or its arguments
    cannot join (or fail to load: run alone, they fail there)."""
    if not call.joinable:
        return None
    batcher = batcher_of(target.key)
    if batcher is None or in_dist_autograd_context():
        return None
    if getattr(hosted_module(target.key), "training", False):
        batcher.count("in_training_mode")
        return None  # (a module in training mode may pool over its batch: batch norm, dropout)
    dev = host_device(target.device)
    try:
        args, kwargs = loads(call.payload)
        args, kwargs = prepare_inputs(args, kwargs, dev)
    except BaseException:  # (run alone, it fails there the same way, alone)
        return None
    queued = batcher.submit(args, kwargs, group)
    if queued is None:
        return None

    def answer(got: Future) -> tuple:
        kind, value = got.value()
        if kind == "ok":
            try:
                result = dumps(prepare_output(value, dev, target.is_device_map_set), inline=call.inline)
            except BaseException as exc:
                result = capture(exc)
        else:
            result = capture(value)
        return Answer(result, _clock() - start).wire()

    return queued.then(answer)


def _answered_alone(where: Target, call: Call, start: float) -> tuple:
    """``call`` run alone, answered (``Answer.wire()``), its seconds counted from ``start``."""
    return Answer(_run_call(where, call), _clock() - start).wire()


def _done(value: Any) -> Future:
    done: Future = Future()
    done.set_result(value)
    return done


# ---- handlers ---------------------------------------------------------------------------


# Records arrive and leave in their wire form (remote_module._proxy.call_records: plain tuples).


def _call_one(target: tuple, call: tuple) -> tuple:
    """One ``forward`` call: ``Answer.wire()`` of ``Call.wire()``. (A call to a module that
    batches, from a proxy that does not know it, waits here for its batch.)"""
    start = _clock()
    where, made = Target._make(target), Call.from_wire(call)
    if made.joinable and batching._batchers:  # (no call at all while no module of this host batches)
        joined = _joining(where, made, None, start)
        if joined is not None:
            return joined.wait()
    return _answered_alone(where, made, start)


@rpc.functions.async_execution
def _call_one_joining(target: tuple, call: tuple) -> Future:
    """:func:`_call_one` for a proxy whose module batches: returns at once, answered when the
    call's batch has run (no RPC thread waits for it)."""
    start = _clock()
    where, made = Target._make(target), Call.from_wire(call)
    joined = _joining(where, made, None, start)
    return _done(_answered_alone(where, made, start)) if joined is None else joined


@rpc.functions.async_execution
def _call_many_joining(target: tuple, calls: list[tuple]) -> Future:
    """:func:`_call_many` for a proxy whose module batches. The message's calls run in the order
    made: one that cannot join runs after every earlier call of the message is answered, and
    so does every later call of the message (a later call that joined a batch could run first)."""
    where, group = Target._make(target), object()
    answered: list[Future] = []
    alone_before = False
    for wired in calls:
        start, made = _clock(), Call.from_wire(wired)
        joined = None if alone_before else _joining(where, made, group, start)
        if joined is None:
            alone_before = True
            def alone(_: Any, made: Call = made, start: float = start) -> tuple:
                return _answered_alone(where, made, start)

            joined = torch.futures.collect_all(answered).then(alone) if answered else _done(alone(None))
        answered.append(joined)
    return torch.futures.collect_all(answered).then(lambda got: [f.value() for f in got.value()])


def _call_many(target: tuple, calls: list[tuple]) -> list[tuple]:
    """Calls that share a message (see remote_module._proxy.channel), run in the order made."""
    where = Target._make(target)
    answers = []
    for call in calls:
        start = _clock()
        result = _run_call(where, Call.from_wire(call))
        answers.append(Answer(result, _clock() - start).wire())
    return answers
