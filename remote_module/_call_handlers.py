"""Host-side RPC handlers of ``forward`` calls: one call, or several that share a message.

Module-level so RPC pickles them by reference; the host imports this installed module on
first use and needs nothing else imported beforehand.
"""

from __future__ import annotations

import pickle
import time
from typing import Any

import torch

from remote_module._device import prepare_inputs, prepare_output
from remote_module._errors import capture
from remote_module._handlers import _device, _lookup
from remote_module._inline import pack, unpack


def _call(
    args: tuple, kwargs: dict, key: int, device: str, grad_enabled: bool, inline: bool, is_device_map_set: bool
) -> Any:
    """One ``forward`` call. ``inline``: the caller inlined small tensors and accepts inlined
    ones back (it has no distributed autograd context and no device map)."""
    try:
        module = _lookup(key)
        dev = _device(device)
        if inline:
            args, kwargs = unpack(args), unpack(kwargs)
        args, kwargs = prepare_inputs(args, kwargs, dev)
        if grad_enabled == torch.is_grad_enabled():
            out = module(*args, **kwargs)
        else:
            with torch.set_grad_enabled(grad_enabled):
                out = module(*args, **kwargs)
        out = prepare_output(out, dev, is_device_map_set)
        return pack(out) if inline else out
    except Exception as exc:
        return capture(exc)


def _call_many(calls: list, key: int, device: str, is_device_map_set: bool) -> tuple[list, float]:
    """Several pipelined ``forward`` calls (see remote_module._pipeline), run in order.

    Each entry is (pickled (args, kwargs) with inlined tensors, grad mode); each result is the
    packed output or the call's own RemoteFailure. Also returns the seconds spent in all.
    """
    start = time.perf_counter()
    out = []
    for payload, grad_enabled in calls:
        try:
            args, kwargs = pickle.loads(payload)
        except Exception as exc:
            out.append(capture(exc))
            continue
        out.append(_call(args, kwargs, key, device, grad_enabled, True, is_device_map_set))
    return out, time.perf_counter() - start
