"""Creating a proxy's module on its host in one message (``RemoteModule(...)`` and
``RemoteModule.create_async(...)``).

The caller checks the constructor arguments, then sends one host call (through
:func:`remote_module._core.fanout.call_async`) that builds the module, holds it by key and answers
with its description and an RRef owned by the host (``_host._create``). Nothing waits in
between, so N proxies made one after another are N messages in flight together, about one
round trip in all. The proxy is set up from the answer in the message's callback, which never
blocks (it renders the generated methods, which needs no RPC).
"""

from __future__ import annotations

from typing import Any

from torch.futures import Future

from remote_module._core import call_async, followed
from remote_module._proxy import _host
from remote_module._proxy.codegen import forward_signature, render_scriptable_module
from remote_module._proxy.shipping import pack_constructor

#: torch.distributed.rpc's "use the agent's default timeout", as a proxy stores it.
AGENT_DEFAULT_TIMEOUT = -1.0


def check_constructor_arguments(module_cls: Any, args: Any, kwargs: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for ``module_cls(*args, **kwargs)``, checked on the caller.

    Example::

        >>> import torch
        >>> check_constructor_arguments(torch.nn.Linear, (2, 3), None)
        ((2, 3), {})
    """
    if not callable(module_cls):
        raise TypeError(f"module_cls must be an nn.Module class or a callable returning one, got {module_cls!r}")
    if args is None:
        args = ()
    elif isinstance(args, (tuple, list)):
        args = tuple(args)
    else:
        raise TypeError(f"args must be a tuple of constructor arguments, got {type(args).__name__}: {args!r}")
    if kwargs is None:
        kwargs = {}
    elif isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs):
        kwargs = dict(kwargs)
    else:
        raise TypeError(f"kwargs must be a dict of str to constructor arguments, got {kwargs!r}")
    return args, kwargs


def create_on_host(proxy: Any, module_cls: Any, args: tuple, kwargs: dict) -> Future:
    """Send the creation of ``proxy``'s module (its ``on``, ``device``, ``timeout`` and
    ``module_interface_cls`` already set); a Future of ``proxy``, ready to call.

    What the host raises fails the Future with its original type, naming the worker; so does
    a timeout.

    Example (inside ``RemoteModule``)::

        self._prepare(remote_device, interface_cls, timeout)
        ready = create_on_host(self, torch.nn.Linear, (2, 3), {})
        assert ready.wait() is self
    """
    name = getattr(module_cls, "__qualname__", None) or repr(module_cls)
    local_sig = forward_signature(module_cls) if isinstance(module_cls, type) else None
    # Classes the host cannot import (defined in __main__ or a function) go by value.
    module_cls, args, kwargs = pack_constructor(module_cls, args, kwargs)
    interface_cls = proxy.module_interface_cls
    if interface_cls is not None:
        render_scriptable_module(interface_cls)  # caller side: validates the interface
    created = call_async(
        proxy.on,
        _host._create,
        (module_cls, args, kwargs, proxy.device, interface_cls, proxy.batching),
        timeout=None if proxy.timeout == AGENT_DEFAULT_TIMEOUT else proxy.timeout,
        label=f"RemoteModule creation of {name!r}",
    )

    def finish(fut: Future) -> Any:
        info, rref = fut.value()
        proxy.module_rref = rref
        proxy._finish(info, local_sig)
        return proxy

    return followed(created, finish)
