"""The ``nn.Module`` methods a RemoteModule proxy does not support, as one table.

The proxy's methods and the tests are both generated from :data:`UNSUPPORTED_METHODS`.
"""

from __future__ import annotations

from typing import Any, Callable

#: method name -> advice appended to the error (empty: none).
UNSUPPORTED_METHODS: dict[str, str] = {
    "register_buffer": "",
    "register_parameter": "",
    "add_module": "",
    "cuda": "",
    "cpu": "",
    "ipu": "",
    "xpu": "",
    "type": "",
    "float": "",
    "double": "",
    "half": "",
    "bfloat16": "",
    "to": "",
    "register_backward_hook": "",
    "register_full_backward_hook": "",
    "register_full_backward_pre_hook": "",
    "register_forward_pre_hook": "",
    "register_forward_hook": "",
    "register_state_dict_pre_hook": "",
    "register_load_state_dict_post_hook": "",
    "parameters": "Please use ``remote_parameters`` instead.",
    "named_parameters": "",
    "buffers": "",
    "named_buffers": "",
    "children": "",
    "named_children": "",
    "modules": "",
    "named_modules": "",
    "apply": "",
    "state_dict": "",
    "load_state_dict": "",
    "requires_grad_": "",
    "zero_grad": "",
    "share_memory": "",
    "extra_repr": "",
}


def not_supported_message(name: str) -> str:
    """The torch-compatible error text for an unsupported method ``name``."""
    advice = UNSUPPORTED_METHODS.get(name, "")
    msg = f"Method ``{name}`` not supported for RemoteModule"
    return f"{msg}. {advice}" if advice else msg


def make_unsupported(name: str) -> Callable[..., Any]:
    """A method that raises the torch-compatible ``ValueError`` for ``name``."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(not_supported_message(name))

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"Not supported on a RemoteModule: raises ``ValueError``. {UNSUPPORTED_METHODS[name]}"
    return method
