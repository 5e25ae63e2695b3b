"""How a RemoteModule proxy travels inside RPC messages, and only there.

Only the attributes named in :data:`PICKLED_ATTRIBUTES` are sent; the receiver rebuilds the
generated ``forward``/``forward_async`` itself. Every other instance attribute must be listed
in :data:`IGNORED_ATTRIBUTES`: the proxy's constructor checks this, and an attribute added
to an instance later is dropped with a warning when the proxy is sent.
"""

from __future__ import annotations

import io
import warnings

import torch
from torch import nn

from remote_module._torch_private import script_module_has_attribute

#: Attributes sent when a proxy is an argument or result of an RPC.
PICKLED_ATTRIBUTES: tuple[str, ...] = (
    "on",
    "device",
    "is_device_map_set",
    "is_scriptable",
    "module_rref",
    "module_key",
    "module_interface_cls",
    "forward_signature",
    "remote_type",
    "remote_repr",
    "timeout",
)

#: Attributes deliberately not sent: ``nn.Module``'s own bookkeeping (read from this torch,
#: so a torch release that adds one does not break the check) and the generated methods,
#: which the receiver renders again.
IGNORED_ATTRIBUTES: tuple[str, ...] = tuple(vars(nn.Module()).keys()) + (
    "forward",
    "forward_async",
    "_host_info",  # a per-process cache of the host's WorkerInfo
    "_channel",  # per-process call channel: coalescing, deadlines, order (remote_module._channel)
)

NOT_PICKLABLE = "Cannot pickle RemoteModule in python pickler. RemoteModule can only be pickled when using RPC"
NOT_UNPICKLABLE = "Cannot unpickle RemoteModule in python pickler. RemoteModule can only be unpickled when using RPC"
SCRIPTED_OVER_RPC = (
    "Passing a script RemoteModule over RPC is not supported. Please create a RemoteModule in the "
    "sender, send its `module_rref` (remote_module.get_module_rref()) to the receiver, and create a "
    "new instance there with RemoteModule.init_from_module_rref(remote_device, module_rref, "
    "_module_interface_cls)."
)


def check_attributes(proxy: nn.Module) -> None:
    """Raise ``AttributeError`` naming any attribute that is neither sent nor ignored."""
    for name in vars(proxy):
        if name not in PICKLED_ATTRIBUTES and name not in IGNORED_ATTRIBUTES:
            raise AttributeError(
                f"Attribute {name} must be either in ``remote_module.PICKLED_ATTRIBUTES`` or "
                "``remote_module._pickling.IGNORED_ATTRIBUTES``."
            )


def reduce_proxy(proxy: nn.Module) -> tuple:
    """RPC reducer: ``(rebuild, (cls, state))`` with the pickled attributes only."""
    state = {}
    for name, value in vars(proxy).items():
        if name in PICKLED_ATTRIBUTES:
            state[name] = value
        elif name not in IGNORED_ATTRIBUTES:
            warnings.warn(
                f"Attribute {name!r} of {type(proxy).__name__} is not sent over RPC: it is in neither "
                "remote_module.PICKLED_ATTRIBUTES nor the ignored attributes. Keep per-proxy state in "
                "the remote module instead.",
                RuntimeWarning,
                stacklevel=2,
            )
    return rebuild_proxy, (type(proxy), state)


def rebuild_proxy(cls: type, state: dict) -> nn.Module:
    """RPC receiver side of :func:`reduce_proxy`."""
    proxy = cls.__new__(cls)
    nn.Module.__init__(proxy)
    for name, value in state.items():
        object.__setattr__(proxy, name, value)
    proxy._install_generated_methods()
    return proxy


def reduce_script_module(module: torch.jit.RecursiveScriptModule) -> tuple:
    """RPC reducer for script modules: a scripted RemoteModule cannot travel; others can."""
    if script_module_has_attribute(module, "module_rref"):
        raise RuntimeError(SCRIPTED_OVER_RPC)
    buf = io.BytesIO()
    torch.jit.save(module, buf)
    return _load_script_module, (buf.getvalue(),)


def _load_script_module(data: bytes) -> torch.jit.ScriptModule:
    return torch.jit.load(io.BytesIO(data))
