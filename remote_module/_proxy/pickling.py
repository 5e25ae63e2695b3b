"""How a RemoteModule proxy travels inside RPC messages, and only there.

Only the attributes named in the proxy's class's ``PICKLED_ATTRIBUTES`` are sent
(:data:`PICKLED_ATTRIBUTES` for ``RemoteModule``; a subclass extends it, see
:func:`pickled_attributes`); the receiver rebuilds the generated ``forward``/``forward_async``
itself and works out ``is_device_map_set`` for itself (it describes the receiver's device map
towards the host, not the sender's). Every other instance attribute must be listed in
:data:`IGNORED_ATTRIBUTES`: the proxy's constructor checks this, and an attribute added to an
instance later is dropped with a warning when the proxy is sent.
"""

from __future__ import annotations

import io
import warnings

import torch
from torch import nn

from remote_module._core import device_map_to, script_module_has_attribute, uses_device_map

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
    "remote_trainable",
    "timeout",
    "batching",
)

#: Pickled attributes a subclass that lists its own may leave out (then they do not travel:
#: a received proxy without ``batching`` sends calls that the host still joins, through the
#: handler that waits for them)
OPTIONAL_ATTRIBUTES: tuple[str, ...] = ("batching",)

#: Attributes deliberately not sent: ``nn.Module``'s own bookkeeping (read from this torch,
#: so a torch release that adds one does not break the check) and the generated methods,
#: which the receiver renders again.
IGNORED_ATTRIBUTES: tuple[str, ...] = tuple(vars(nn.Module()).keys()) + (
    "forward",
    "forward_async",
    "_host_info",  # a per-process cache of the host's WorkerInfo
    "_channel",  # per-process call channel: coalescing, deadlines, order (remote_module._proxy.channel)
    "_warned_untrained",  # this proxy object warned of training outside dist autograd (remote_module._core.untrained)
    "_warned_training_batch",  # this proxy object warned that a batching module in training mode joins nothing
)

#: torch's text, then why and what to do (torch.save(model) of a model holding a proxy, with RPC
#: running, is the usual way to meet it)
NOT_PICKLABLE = (
    "Cannot pickle RemoteModule in python pickler. RemoteModule can only be pickled when using RPC"
    " (as an argument or result of an RPC call, where it stays a handle to the module on its host). "
    "torch.save(model) or pickle of a model holding one would save that handle, not the module's "
    "weights, and no later process could use it: save model.state_dict() instead (it holds copies of "
    "the remote module's parameters and buffers) and load it into a model built the same way with "
    "model.load_state_dict()."
)
NOT_UNPICKLABLE = "Cannot unpickle RemoteModule in python pickler. RemoteModule can only be unpickled when using RPC"
SCRIPTED_OVER_RPC = (
    "Passing a script RemoteModule over RPC is not supported. Please create a RemoteModule in the "
    "sender, send its `module_rref` (remote_module.get_module_rref()) to the receiver, and create a "
    "new instance there with RemoteModule.init_from_module_rref(remote_device, module_rref, "
    "_module_interface_cls)."
)


def pickled_attributes(cls: type) -> tuple[str, ...]:
    """The attributes sent with a proxy of class ``cls``: its ``PICKLED_ATTRIBUTES``.

    Example (a subclass with one more attribute that travels)::

        class Tagged(RemoteModule):
            PICKLED_ATTRIBUTES = RemoteModule.PICKLED_ATTRIBUTES + ("tag",)

        assert pickled_attributes(Tagged)[-1] == "tag"
    """
    return getattr(cls, "PICKLED_ATTRIBUTES", PICKLED_ATTRIBUTES)


def check_declared_attributes(cls: type) -> None:
    """Check a proxy class's ``PICKLED_ATTRIBUTES``: a tuple of str that extends the base tuple
    and names no ignored attribute. Raises ``TypeError``/``ValueError`` saying how to declare it.

    Example (run by ``RemoteModule.__init_subclass__`` when a subclass is made)::

        class Bad(RemoteModule):
            PICKLED_ATTRIBUTES = ("label",)   # ValueError: lacks ['on', 'device', ...]
    """
    declared = pickled_attributes(cls)
    how = f"declare e.g. PICKLED_ATTRIBUTES = RemoteModule.PICKLED_ATTRIBUTES + ('my_attribute',) in {cls.__name__}"
    if not isinstance(declared, tuple) or not all(isinstance(name, str) for name in declared):
        raise TypeError(f"{cls.__qualname__}.PICKLED_ATTRIBUTES must be a tuple of str, got {declared!r}: {how}")
    missing = [name for name in PICKLED_ATTRIBUTES if name not in declared and name not in OPTIONAL_ATTRIBUTES]
    if missing:
        raise ValueError(
            f"{cls.__qualname__}.PICKLED_ATTRIBUTES lacks {missing} that every proxy needs on arrival: {how}"
        )
    ignored = [name for name in declared if name in IGNORED_ATTRIBUTES]
    if ignored:
        raise ValueError(
            f"{cls.__qualname__}.PICKLED_ATTRIBUTES names {ignored}, which are per-process and never "
            f"sent (nn.Module bookkeeping, generated methods, caches): {how}"
        )


def check_attributes(proxy: nn.Module) -> None:
    """Raise ``AttributeError`` naming any attribute that is neither sent nor ignored."""
    sent = pickled_attributes(type(proxy))
    for name in vars(proxy):
        if name not in sent and name not in IGNORED_ATTRIBUTES and name not in OPTIONAL_ATTRIBUTES:
            raise AttributeError(
                f"Attribute {name} must be either in ``remote_module.PICKLED_ATTRIBUTES`` or "
                "``remote_module._proxy.pickling.IGNORED_ATTRIBUTES``. A subclass of RemoteModule declares "
                f"its own: PICKLED_ATTRIBUTES = RemoteModule.PICKLED_ATTRIBUTES + ({name!r},)."
            )


def reduce_proxy(proxy: nn.Module) -> tuple:
    """RPC reducer: ``(rebuild, (cls, state))`` with the pickled attributes only."""
    sent = pickled_attributes(type(proxy))
    state = {}
    for name, value in vars(proxy).items():
        if name in sent:
            state[name] = value
        elif name not in IGNORED_ATTRIBUTES and name not in OPTIONAL_ATTRIBUTES:
            warnings.warn(
                f"Attribute {name!r} of {type(proxy).__name__} is not sent over RPC: it is in neither "
                f"{type(proxy).__name__}.PICKLED_ATTRIBUTES nor the ignored attributes. Keep per-proxy state "
                "in the remote module, or declare it in a subclass: "
                f"PICKLED_ATTRIBUTES = RemoteModule.PICKLED_ATTRIBUTES + ({name!r},).",
                RuntimeWarning,
                stacklevel=2,
            )
    return rebuild_proxy, (type(proxy), state)


def device_map_is_set(on: str, device: str) -> bool:
    """``is_device_map_set`` as this process sees it: a module off the CPU on worker ``on``, and a
    device map from this process towards ``on`` (see :func:`remote_module._core.device.uses_device_map`).

    Example (a process whose TensorPipe options map its cuda:0 to worker1's cuda:1)::

        device_map_is_set("worker1", "cuda:1")   # True here; False where no map is set
        device_map_is_set("worker1", "cpu")      # always False
    """
    if torch.device(device).type == "cpu":
        return False  # no lookup: the map does not matter for a CPU module
    return uses_device_map(device, device_map_to(on))


def rebuild_proxy(cls: type, state: dict) -> nn.Module:
    """RPC receiver side of :func:`reduce_proxy`: ``is_device_map_set`` is recomputed here."""
    proxy = cls.__new__(cls)
    nn.Module.__init__(proxy)
    proxy._declare_process_state()
    for name, value in state.items():
        object.__setattr__(proxy, name, value)
    object.__setattr__(proxy, "is_device_map_set", device_map_is_set(state["on"], state["device"]))
    # (its host's training flag is unknown here: no warning of training mode from a received proxy)
    object.__setattr__(proxy, "_warned_training_batch", True)
    proxy._install_generated_methods()
    from remote_module._proxy.idioms import install_handle

    install_handle(proxy, state["remote_trainable"])
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
