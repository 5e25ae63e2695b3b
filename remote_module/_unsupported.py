"""The ``nn.Module`` methods a RemoteModule proxy does not support, as one table.

The proxy's methods and the tests are both generated from :data:`UNSUPPORTED_METHODS`.
"""

from __future__ import annotations

from typing import Any, Callable

_MOVE = (
    "The remote module stays where remote_device put it: create the RemoteModule with the "
    "device you want (e.g. 'worker1/cuda:0'). Moving or casting a model that holds this proxy "
    "is fine and leaves the remote module alone."
)
_REGISTER = (
    "A proxy holds no local state: register it on the module built by module_cls instead "
    "(in its __init__)."
)
_HOOK = "Hooks on the proxy would not run on the host: register them in module_cls's __init__ instead."
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
    "parameters": "Please use ``remote_parameters`` instead.",
    "named_parameters": "Please use ``remote_parameters`` (RRefs) or ``state_dict()`` (copies) instead.",
    "buffers": "Please use ``state_dict()`` to read copies of the remote buffers.",
    "named_buffers": "Please use ``state_dict()`` to read copies of the remote buffers.",
    "requires_grad_": "Set requires_grad on the parameters inside module_cls instead.",
    "zero_grad": _GRADS,
    "share_memory": "The remote module is in another process; share_memory does not apply.",
}


def not_supported_message(name: str) -> str:
    """The torch-compatible error text for an unsupported method ``name``."""
    return f"Method ``{name}`` not supported for RemoteModule. {UNSUPPORTED_METHODS[name]}"


def make_unsupported(name: str) -> Callable[..., Any]:
    """A method that raises the torch-compatible ``ValueError`` for ``name``."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(not_supported_message(name))

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"Not supported on a RemoteModule: raises ``ValueError``. {UNSUPPORTED_METHODS[name]}"
    return method
