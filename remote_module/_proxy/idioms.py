"""Freezing, casting and deep-copying a proxy as torch does a local module.

``nn.Module.requires_grad_`` sets the flag on each of ``model.parameters()``, and a proxy has
no local parameters of its own, so each proxy holds one *handle*: a zero-element parameter
named :data:`HANDLE` whose ``requires_grad`` mirrors whether the remote module has
parameters that require grad. ``model.requires_grad_(flag)`` reaches it like any parameter,
and the handle's ``requires_grad_`` applies the flag to the remote module on its host;
``p.requires_grad = flag`` over ``model.parameters()`` (an attribute, which no method sees)
is applied by the proxy's next forward. The handle never receives a gradient, and the proxy
lists no parameters when asked alone (``named_parameters(recurse=False)``), so
``DistributedDataParallel`` (which builds its buckets from exactly that) leaves it out.

Casts go through ``nn.Module._apply(fn)``: :func:`dtype_casts` asks ``fn`` what it does to an
empty tensor of each dtype, and the remote module applies that on its host, as ``fn`` would
to a local module's tensors (``model.double()`` casts floating tensors, ``model.type(dtype)``
every tensor). Device moves stay local: the remote module stays where ``remote_device`` put it.

Inside a distributed autograd context no gradient is in ``.grad``: reading the handle's warns
once per process, naming ``remote_module.clip_grad_norm_`` (``remote_module._proxy.context_grads``).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable

import torch
from torch import nn

from remote_module._proxy.context_grads import warn_grad_read_in_context

#: The handle's name among a model's parameters (``model.named_parameters()`` lists
#: ``"<proxy's name>.remote_requires_grad"``, a zero-element tensor).
HANDLE = "remote_requires_grad"

#: The dtypes :func:`dtype_casts` asks ``fn`` about.
PROBED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
)


class RequiresGradHandle(nn.Parameter):
    """A proxy's zero-element parameter: its ``requires_grad_`` sets the remote module's.

    Example::

        model = nn.Sequential(proxy, nn.Linear(8, 2))
        model.requires_grad_(False)     # freezes the remote module on its host, too
    """

    def __new__(cls, data: torch.Tensor | None = None, requires_grad: bool = True,
                proxy: nn.Module | None = None) -> RequiresGradHandle:
        handle = super().__new__(cls, data, requires_grad)
        # weakly: the proxy holds its handle; None in a copy of the tensor alone (copy.deepcopy
        # makes one with type(self)(data, requires_grad))
        handle._proxy_ref = None if proxy is None else weakref.ref(proxy)
        return handle

    def proxy(self) -> nn.Module | None:
        """The proxy this handle belongs to, or None (it was collected, or this is a copy of the
        handle alone)."""
        return None if self._proxy_ref is None else self._proxy_ref()

    def requires_grad_(self, requires_grad: bool = True) -> RequiresGradHandle:  # type: ignore[override]
        proxy = self.proxy()
        if proxy is None:  # a copy made without its proxy (copy.deepcopy of the tensor alone)
            return super().requires_grad_(requires_grad)
        proxy._set_remote_requires_grad(requires_grad)  # sets this handle's flag from the answer
        return self

    # ``.grad`` is torch's own (always None: the handle never gets a gradient), but reading it
    # inside a distributed autograd context warns once per process: whoever reads ``.grad`` over
    # ``model.parameters()`` there (torch's clip_grad_norm_, a local optimizer) sees no gradient
    # at all, the remote module's or the local parameters' (remote_module._proxy.context_grads).
    @property
    def grad(self) -> torch.Tensor | None:  # type: ignore[override]
        warn_grad_read_in_context()
        return torch.Tensor.grad.__get__(self)

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        torch.Tensor.grad.__set__(self, value)

    @grad.deleter
    def grad(self) -> None:
        torch.Tensor.grad.__delete__(self)

    def __reduce_ex__(self, protocol: Any) -> tuple:
        # pickled alone (torch.save(list(model.parameters()))): a plain zero-element parameter
        return nn.Parameter, (self.detach(), self.requires_grad)


def install_handle(proxy: nn.Module, requires_grad: bool, like: torch.Tensor | None = None) -> None:
    """Give ``proxy`` its handle (of ``like``'s dtype and device, else the default dtype on the CPU)."""
    data = torch.empty(0) if like is None else torch.empty(0, dtype=like.dtype, device=like.device)
    handle = RequiresGradHandle(data, requires_grad=bool(requires_grad), proxy=proxy)
    proxy._parameters[HANDLE] = handle  # register_parameter is refused on a proxy


def dtype_casts(fn: Callable[[torch.Tensor], Any], device: torch.device) -> dict[torch.dtype, torch.dtype]:
    """``{dtype: dtype fn gives}`` for each of :data:`PROBED_DTYPES` that ``fn`` changes, asked
    of empty tensors on ``device``. ``fn``'s own errors (``.cuda()`` where there is no CUDA)
    propagate, as they would from a local module's tensors; its warnings (casting complex to
    real) are the host's to give, for tensors it has.

    Example::

        >>> dtype_casts(lambda t: t.double() if t.is_floating_point() else t, torch.device("cpu"))[torch.float32]
        torch.float64
    """
    casts = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for dtype in PROBED_DTYPES:
            out = fn(torch.empty(0, dtype=dtype, device=device))
            if isinstance(out, torch.Tensor) and out.dtype != dtype:
                casts[dtype] = out.dtype
    return casts
