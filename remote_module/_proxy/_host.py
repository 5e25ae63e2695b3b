"""Host-side RPC handlers of RemoteModule.

Every function here runs on the worker that hosts the module. They are module-level so RPC
pickles them by reference: the host imports this installed module on first use and needs
nothing else imported beforehand (no generated code lives on the host for plain proxies).
"""

from __future__ import annotations

import copy
import inspect
import pickle
from functools import partial
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import nn

from remote_module._core import as_python_module, host_device, host_objects, script_class_name
from remote_module._proxy._host_calls import forward_no_grad
from remote_module._proxy.batching import batcher_of, start_batching
from remote_module._proxy.shipping import unpack_constructor
from remote_module._proxy.state_dict import load_at

_NOT_A_MODULE = (
    "Expect `module_cls(*args, **kwargs)` returns an instance of <class nn.Module>, "
    "but it returns an instance of {}."
)


def _build_module(module_cls: Any, args: tuple, kwargs: dict, device: str) -> nn.Module:
    module_cls, args, kwargs = unpack_constructor(module_cls, args, kwargs)
    module = module_cls(*args, **kwargs)
    if not isinstance(module, nn.Module):
        raise ValueError(_NOT_A_MODULE.format(type(module)))
    return module.to(host_device(device))


#: A default whose pickle is larger than this is shown, not sent, in a proxy's signature.
SIGNATURE_DEFAULT_MAX_BYTES = 16 * 1024
_REPR_MAX_CHARS = 200


class ShownDefault:
    """Stands in for a default in a proxy's portable signature: shows as the original.

    Defaults are evaluated on the host (they never travel with a call), so a received proxy
    only displays them; this placeholder keeps that display when the original cannot be
    pickled (a lambda closing over a lock) or is large (a 16 MB tensor).

    Example::

        >>> ShownDefault("<function <lambda>>")
        <function <lambda>>
    """

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ShownDefault) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)


def _sendable(value: Any, limit: int | None = None) -> bool:
    """Whether ``value`` pickles (to at most ``limit`` bytes, when given)."""
    if limit is not None and isinstance(value, torch.Tensor):
        try:
            if value.untyped_storage().nbytes() > limit:
                return False  # known too big without pickling it
        except Exception:
            pass
    try:
        data = pickle.dumps(value)
    except Exception:
        return False
    return limit is None or len(data) <= limit


def _shown(value: Any) -> ShownDefault:
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__qualname__} object>"
    if len(text) > _REPR_MAX_CHARS:
        text = text[: _REPR_MAX_CHARS - 3] + "..."
    return ShownDefault(text)


def portable_signature(sig: inspect.Signature | None) -> inspect.Signature | None:
    """A copy of ``sig`` that pickles, for a proxy sent over RPC (which renders its methods
    from it): an annotation that does not pickle is dropped; a default that does not pickle,
    or pickles to more than :data:`SIGNATURE_DEFAULT_MAX_BYTES`, becomes a
    :class:`ShownDefault` with its repr. Parameter names and kinds are kept, so the receiver
    checks calls exactly as the sender does.

    Example::

        sig = portable_signature(forward_signature(torch.nn.Linear))   # on the host, in _describe
        pickle.dumps(sig)   # always works; a lambda default shows as <function <lambda> at ...>
    """
    if sig is None:
        return None
    empty = inspect.Parameter.empty
    params = []
    for p in sig.parameters.values():
        if p.annotation is not empty and not _sendable(p.annotation):
            p = p.replace(annotation=empty)
        if p.default is not empty and not _sendable(p.default, SIGNATURE_DEFAULT_MAX_BYTES):
            p = p.replace(default=_shown(p.default))
        params.append(p)
    ret = sig.return_annotation
    if ret is not inspect.Signature.empty and not _sendable(ret):
        ret = inspect.Signature.empty
    return sig.replace(parameters=params, return_annotation=ret)


# ---- handlers ---------------------------------------------------------------------------


def _create(
    module_cls: Any, args: tuple, kwargs: dict, device: str, interface_cls: type | None, batching: Any = None
) -> tuple[dict, rpc.RRef]:
    """Create ``module_cls(*args, **kwargs)`` on ``device`` and return its description with an
    RRef owned here: a proxy's whole construction in one message (run through
    :mod:`remote_module._core.fanout`, which carries an exception back with its type).

    With ``interface_cls`` the module is scripted and the RRef is typed with that TorchScript
    interface (what a scriptable proxy's script code calls). ``batching``: a
    :class:`~remote_module._proxy.batching.BatchPolicy` under which the module joins concurrent
    calls (a plain module only; the caller checks).
    """
    if interface_cls is None:
        module = _build_module(module_cls, args, kwargs, device)
        rref = rpc.RRef(module)
        if batching is not None:
            _start_batching(module, batching)
    else:
        from remote_module._proxy.codegen import render_scriptable_module

        render_scriptable_module(interface_cls)  # compiles _remote_forward here, before any call
        module = torch.jit.script(_build_module(module_cls, args, kwargs, device))
        rref = rpc.RRef(module, interface_cls)
    return _description(module), rref


def _prepare_scriptable(interface_cls: type) -> None:
    """Compile the scriptable template on this host (for init_from_module_rref)."""
    from remote_module._proxy.codegen import render_scriptable_module

    render_scriptable_module(interface_cls)


def _description(module: nn.Module) -> dict:
    """What a proxy learns about its module when it is made; holds the module by key (weakly)."""
    from remote_module._proxy.codegen import forward_signature

    scripted = script_class_name(module)
    sig = None if scripted is not None else forward_signature(module)
    return {
        # A ScriptModule's Python wrapper dies with this call (the RRef holds the TorchScript
        # object): scriptable proxies name their module by RRef instead of by key.
        "key": None if scripted is not None else host_objects.hold_weakly(module),
        "type": scripted or f"{type(module).__module__}.{type(module).__qualname__}",
        "signature": portable_signature(sig),
        "repr": repr(module),
        # whether a forward with grad enabled needs distributed autograd (remote_module._core.untrained)
        "trainable": has_trainable_parameters(module),
        # its training flag now (a proxy's last value seen: see remote_module._proxy.module_state)
        "training": bool(module.training),
        # the BatchPolicy under which it joins concurrent calls (remote_module._proxy.batching)
        "batching": None if scripted is not None else _policy_of(module),
    }


def _start_batching(module: nn.Module, policy: Any) -> None:
    """Give ``module`` (held here by key, weakly) a batcher under ``policy``."""
    key = host_objects.hold_weakly(module)
    start_batching(key, module, policy, partial(forward_no_grad, key))


def _batcher(module: nn.Module) -> Any:
    """``module``'s batcher, None when it does not batch."""
    return batcher_of(host_objects.hold_weakly(module))


def _policy_of(module: nn.Module) -> Any:
    batcher = _batcher(module)
    return None if batcher is None else batcher.policy


def has_trainable_parameters(module: nn.Module) -> bool:
    """Whether ``module`` or a submodule has a parameter that requires grad. Walks children by
    identity, so a module that is not hashable (``parameters()`` keeps a set of modules) works."""
    seen: set[int] = set()
    stack = [module]
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        if any(p is not None and p.requires_grad for p in m._parameters.values()):
            return True
        stack.extend(c for c in m._modules.values() if c is not None)
    return False


def _describe(module_rref: rpc.RRef) -> dict:
    """Wait for the module behind ``module_rref`` to exist and describe it (what it raised
    while being created reaches the caller as this call's error)."""
    return _description(as_python_module(module_rref.local_value()))


def _param_rrefs(module_rref: rpc.RRef, recurse: bool) -> list[rpc.RRef]:
    return [rpc.RRef(p) for p in module_rref.local_value().parameters(recurse)]


def _batching_stats(module_rref: rpc.RRef) -> dict | None:
    """The module's batcher's counts (``Batcher.stats``), None when it does not batch."""
    batcher = _batcher(as_python_module(module_rref.local_value()))
    return None if batcher is None else batcher.stats()


def _train(module_rref: rpc.RRef, mode: bool) -> None:
    module_rref.local_value().train(mode)


def _set_requires_grad(module_rref: rpc.RRef, requires_grad: bool) -> bool:
    """``module.requires_grad_(requires_grad)``; whether it now has trainable parameters."""
    module = as_python_module(module_rref.local_value())
    if isinstance(module, torch.jit.ScriptModule):  # refuses requires_grad_; a model holding one
        for p in module.parameters():  # sets its parameters' flags, as here
            p.requires_grad_(requires_grad)
    else:
        module.requires_grad_(requires_grad)
    return has_trainable_parameters(module)


def _cast(module_rref: rpc.RRef, casts: dict) -> None:
    """Cast the module's tensors (and their grads) of each dtype in ``casts`` to the dtype it
    maps to, as ``nn.Module._apply`` does a local module's (see remote_module._proxy.idioms)."""
    module = as_python_module(module_rref.local_value())
    module._apply(lambda t: t.to(casts[t.dtype]) if t.dtype in casts else t)


def _deepcopy(module_rref: rpc.RRef, interface_cls: type | None) -> tuple[dict, rpc.RRef]:
    """``copy.deepcopy`` of the module, here: its description and an RRef owned here (as
    :func:`_create` returns for a new module)."""
    original = module_rref.local_value()
    copied = copy.deepcopy(as_python_module(original))
    rref = rpc.RRef(copied) if interface_cls is None else rpc.RRef(copied, interface_cls)
    policy = None if interface_cls is not None else _policy_of(original)
    if policy is not None:  # the copy batches as the original does (its proxy's copy says so)
        _start_batching(copied, policy)
    return _description(copied), rref


def _training(module_rref: rpc.RRef) -> bool:
    return module_rref.local_value().training


def _set_training(module_rref: rpc.RRef, mode: bool) -> None:
    module_rref.local_value().training = mode


def _state_dict(module_rref: rpc.RRef) -> tuple[dict, dict]:
    """CPU copies of the module's state and its per-submodule metadata."""
    sd = module_rref.local_value().state_dict(keep_vars=False)
    metadata = dict(getattr(sd, "_metadata", {}) or {})
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}, metadata


def _load_state_dict(
    state: dict, metadata: dict, module_rref: rpc.RRef, prefix: str = "", assign: bool = False
) -> tuple[list, list, list]:
    """Load ``state`` (keys under ``prefix``) non-strictly, the module placed at ``prefix``;
    return (missing, unexpected, error messages), naming full keys (see ``load_at``)."""
    return load_at(module_rref.local_value(), state, metadata, prefix, assign)
