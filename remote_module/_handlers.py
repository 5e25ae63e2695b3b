"""Host-side RPC handlers of RemoteModule.

Every function here runs on the worker that hosts the module. They are module-level so RPC
pickles them by reference: the host imports this installed module on first use and needs
nothing else imported beforehand (no generated code lives on the host for plain proxies).
"""

from __future__ import annotations

import inspect
import itertools
import pickle
import threading
import time
import weakref
from functools import lru_cache
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import nn

from remote_module._device import prepare_inputs, prepare_output
from remote_module._errors import RemoteFailure, capture
from remote_module._inline import pack, unpack
from remote_module._shipping import unpack_constructor

_NOT_A_MODULE = (
    "Expect `module_cls(*args, **kwargs)` returns an instance of <class nn.Module>, "
    "but it returns an instance of {}."
)


@lru_cache(maxsize=64)
def _device(device: str) -> torch.device:
    return torch.device(device)


def _build(module_cls: Any, args: tuple, kwargs: dict, device: str) -> nn.Module:
    module_cls, args, kwargs = unpack_constructor(module_cls, args, kwargs)
    module = module_cls(*args, **kwargs)
    if not isinstance(module, nn.Module):
        raise ValueError(_NOT_A_MODULE.format(type(module)))
    return module.to(_device(device))


# ---- the host's module registry ----------------------------------------------------------
# Calls name the module by a small integer key instead of sending its RRef each time (an RRef
# argument costs a fork/confirm exchange, ~100 µs). The registry holds weak references only:
# the proxies' RRefs keep a module alive, and its entry disappears with it.

_registry_lock = threading.Lock()
_keys = itertools.count(1)
_module_by_key: dict[int, weakref.ref] = {}
_key_by_id: dict[int, int] = {}  # by id(): a module need not be hashable


def _register(module: nn.Module) -> int:
    with _registry_lock:
        key = _key_by_id.get(id(module))
        ref = _module_by_key.get(key) if key is not None else None
        if ref is not None and ref() is module:
            return key

        key, obj_id = next(_keys), id(module)

        def forget(_: Any) -> None:
            # runs when the module is collected: plain dict operations, no lock (the
            # collector may run while this thread holds it)
            _module_by_key.pop(key, None)
            if _key_by_id.get(obj_id) == key:
                _key_by_id.pop(obj_id, None)

        _module_by_key[key] = weakref.ref(module, forget)
        _key_by_id[id(module)] = key
        return key


def _lookup(key: int) -> nn.Module:
    ref = _module_by_key.get(key)
    module = ref() if ref is not None else None
    if module is None:
        raise RuntimeError(
            f"the module behind this RemoteModule (key {key}) no longer exists on this worker: "
            "every RRef to it was deleted"
        )
    return module


def registered_keys() -> set[int]:
    """The keys of the modules this worker hosts for RemoteModules (for leak checks)."""
    with _registry_lock:
        return set(_module_by_key)


def portable_signature(sig: inspect.Signature | None) -> inspect.Signature | None:
    """``sig`` if it pickles; else without annotations; else None (``(*args, **kwargs)``)."""
    if sig is None:
        return None
    for candidate in (
        sig,
        sig.replace(
            parameters=[p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()],
            return_annotation=inspect.Signature.empty,
        ),
    ):
        try:
            pickle.dumps(candidate)
        except Exception:
            continue
        return candidate
    return None


# ---- handlers ---------------------------------------------------------------------------


def _create_module(module_cls: Any, args: tuple, kwargs: dict, device: str) -> nn.Module | RemoteFailure:
    """Create ``module_cls(*args, **kwargs)`` on ``device``; the caller holds it by RRef.

    A failure becomes the RRef's value, which :func:`_describe` hands back to the caller.
    """
    try:
        return _build(module_cls, args, kwargs, device)
    except Exception as exc:
        return capture(exc)


def _create_scripted_module(
    module_cls: Any, args: tuple, kwargs: dict, device: str, interface_cls: type
) -> rpc.RRef | RemoteFailure:
    """Create, script and wrap the module in an RRef typed with its TorchScript interface."""
    from remote_module._codegen import render_scriptable_module

    try:
        render_scriptable_module(interface_cls)  # compiles _remote_forward here, before any call
        module = torch.jit.script(_build(module_cls, args, kwargs, device))
    except Exception as exc:
        return capture(exc)
    return rpc.RRef(module, interface_cls)


def _prepare_scriptable(interface_cls: type) -> None:
    """Compile the scriptable template on this host (for init_from_module_rref)."""
    from remote_module._codegen import render_scriptable_module

    render_scriptable_module(interface_cls)


def _describe(module_rref: rpc.RRef) -> dict:
    """Wait for the module to exist and describe it (or return its construction failure)."""
    module = module_rref.local_value()
    if isinstance(module, RemoteFailure):
        return {"failure": module}
    from remote_module._codegen import forward_signature

    sig = None if isinstance(module, torch.jit.ScriptModule) else forward_signature(module)
    return {
        "failure": None,
        "key": _register(module),
        "type": f"{type(module).__module__}.{type(module).__qualname__}",
        "signature": portable_signature(sig),
        "training": module.training,
        "repr": repr(module),
    }


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


def _param_rrefs(module_rref: rpc.RRef, recurse: bool) -> list[rpc.RRef]:
    return [rpc.RRef(p) for p in module_rref.local_value().parameters(recurse)]


def _train(module_rref: rpc.RRef, mode: bool) -> None:
    module_rref.local_value().train(mode)


def _state_dict(module_rref: rpc.RRef) -> tuple[dict, dict]:
    """CPU copies of the module's state and its per-submodule metadata."""
    sd = module_rref.local_value().state_dict(keep_vars=False)
    metadata = dict(getattr(sd, "_metadata", {}) or {})
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}, metadata


def _load_state_dict(state: dict, metadata: dict, module_rref: rpc.RRef) -> tuple[list, list, list]:
    """Load ``state`` non-strictly; return (missing, unexpected, error messages)."""
    from collections import OrderedDict

    module = module_rref.local_value()
    sd = OrderedDict(state)
    sd._metadata = OrderedDict(metadata)  # type: ignore[attr-defined]
    try:
        result = module.load_state_dict(sd, strict=False)
    except RuntimeError as exc:  # size mismatches and the like
        return [], [], [str(exc)]
    return list(result.missing_keys), list(result.unexpected_keys), []


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
