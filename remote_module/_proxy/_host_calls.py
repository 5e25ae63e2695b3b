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

from remote_module._core import capture, host_device, hosted_module, prepare_inputs, prepare_output
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


# ---- handlers ---------------------------------------------------------------------------


# Records arrive and leave in their wire form (remote_module._proxy.call_records: plain tuples).


def _call_one(target: tuple, call: tuple) -> tuple:
    """One ``forward`` call: ``Answer.wire()`` of ``Call.wire()``."""
    start = _clock()
    result = _run_call(Target._make(target), Call.from_wire(call))
    return Answer(result, _clock() - start).wire()


def _call_many(target: tuple, calls: list[tuple]) -> list[tuple]:
    """Calls that share a message (see remote_module._proxy.channel), run in the order made."""
    where = Target._make(target)
    answers = []
    for call in calls:
        start = _clock()
        result = _run_call(where, Call.from_wire(call))
        answers.append(Answer(result, _clock() - start).wire())
    return answers
