"""The ``nn.Module`` methods a RemoteModule proxy does not support, as one table.

The proxy's methods and the tests are both generated from :data:`UNSUPPORTED_METHODS`. The
parameter and buffer listings (:data:`EMPTY_WITHOUT_RECURSION`) answer ``recurse=False`` with
nothing, so wrappers that walk every submodule (``DistributedDataParallel``) accept a model
holding a proxy.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from torch import nn

_MOVE = (
    "The remote module stays where remote_device put it: create the RemoteModule with the "
    "device you want (e.g. 'worker1/cuda:0'). Casting a model that holds this proxy "
    "(model.double(), model.to(torch.float64)) casts the remote module on its host; moving "
    "the model leaves the remote module where it is."
)
_REGISTER = (
    "A proxy holds no local state: register it on the module built by module_cls instead "
    "(in its __init__)."
)
_HOOK = "Hooks on the proxy would not run on the host: register them in module_cls's __init__ instead."
_FREEZE = (
    " To freeze or unfreeze the remote module (``for p in proxy.parameters(): p.requires_grad = False``), "
    "call ``proxy.requires_grad_(False)``, which sets the flag of its parameters on the host; "
    "``model.requires_grad_(False)`` on a model holding the proxy reaches it too."
)
_GRADS = (
    "Remote gradients live in distributed autograd contexts: use DistributedOptimizer with "
    "remote_parameters(), or zero_grad() on a model holding this proxy for its local part."
)

#: method name -> advice appended to the error. The proxy's methods and the tests are both
#: generated from this table. A model that *holds* a proxy supports all of them (the proxy is
#: a leaf without local parameters or buffers); only calls on the proxy itself raise.
UNSUPPORTED_METHODS: dict[str, str] = {
    "register_buffer": _REGISTER,
    "register_parameter": _REGISTER,
    "add_module": _REGISTER,
    "register_module": _REGISTER,
    "cuda": _MOVE,
    "cpu": _MOVE,
    "ipu": _MOVE,
    "xpu": _MOVE,
    "mtia": _MOVE,
    "type": _MOVE,
    "float": _MOVE,
    "double": _MOVE,
    "half": _MOVE,
    "bfloat16": _MOVE,
    "to": _MOVE,
    "to_empty": _MOVE,
    "register_backward_hook": _HOOK,
    "register_full_backward_hook": _HOOK,
    "register_full_backward_pre_hook": _HOOK,
    "register_forward_pre_hook": _HOOK,
    "register_forward_hook": _HOOK,
    "register_state_dict_pre_hook": _HOOK,
    "register_state_dict_post_hook": _HOOK,
    "register_load_state_dict_pre_hook": _HOOK,
    "register_load_state_dict_post_hook": _HOOK,
    "parameters": "Please use ``remote_parameters`` instead." + _FREEZE,  # (torch's text first)
    "named_parameters": "Please use ``remote_parameters`` (RRefs) or ``state_dict()`` (copies) instead." + _FREEZE,
    "buffers": "Please use ``state_dict()`` to read copies of the remote buffers.",
    "named_buffers": "Please use ``state_dict()`` to read copies of the remote buffers.",
    "zero_grad": _GRADS,
    "share_memory": "The remote module is in another process; share_memory does not apply.",
}


#: Methods that answer "nothing" when asked about the proxy alone (``recurse=False``): the proxy
#: holds no local parameters or buffers, and DDP, FSDP and optimizers-by-module ask every
#: submodule of a model exactly this. The default ``recurse=True`` still raises, as torch's does.
EMPTY_WITHOUT_RECURSION: tuple[str, ...] = ("parameters", "named_parameters", "buffers", "named_buffers")


def not_supported_message(name: str) -> str:
    """The torch-compatible error text for an unsupported method ``name``."""
    return f"Method ``{name}`` not supported for RemoteModule. {UNSUPPORTED_METHODS[name]}"


def make_unsupported(name: str) -> Callable[..., Any]:
    """A method that raises the torch-compatible ``ValueError`` for ``name``.

    For the names in :data:`EMPTY_WITHOUT_RECURSION` the method takes ``nn.Module``'s
    arguments and returns an empty iterator when called with ``recurse=False``.

    Example::

        >>> class Leaf(nn.Module):
        ...     parameters = make_unsupported("parameters")
        >>> list(Leaf().parameters(recurse=False))
        []
        >>> Leaf().parameters()
        Traceback (most recent call last):
        ValueError: Method ``parameters`` not supported for RemoteModule. Please use ``remote_parameters`` ....
    """
    if name in EMPTY_WITHOUT_RECURSION:
        signature = inspect.signature(getattr(nn.Module, name))

        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(self, *args, **kwargs)  # a wrong call is a TypeError, as on nn.Module
            bound.apply_defaults()
            if not bound.arguments["recurse"]:
                return iter(())
            raise ValueError(not_supported_message(name))

        doc = (
            f"Not supported on a RemoteModule (raises ``ValueError``) except with ``recurse=False``, which "
            f"yields nothing: the proxy holds no local tensors. {UNSUPPORTED_METHODS[name]}"
        )
    else:

        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            raise ValueError(not_supported_message(name))

        doc = f"Not supported on a RemoteModule: raises ``ValueError``. {UNSUPPORTED_METHODS[name]}"
    method.__name__ = method.__qualname__ = name
    method.__doc__ = doc
    return method
