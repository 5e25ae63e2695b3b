"""``RemoteModule``: a local ``nn.Module`` proxy for a module that lives on another worker."""

from __future__ import annotations

import inspect
import pickle
import types
from typing import Any, Callable

import torch
import torch.distributed.rpc as rpc
from torch import nn
from torch.futures import Future

from remote_module import _handlers
from remote_module._codegen import forward_signature, render_forward_methods, render_scriptable_module
from remote_module._device import parse_remote_device
from remote_module._errors import RemoteFailure, reraise, to_exception, unsendable_argument
from remote_module._inline import pack, unpack
from remote_module._pickling import (
    NOT_PICKLABLE,
    NOT_UNPICKLABLE,
    check_attributes,
    reduce_proxy,
    reduce_script_module,
)
from remote_module._shipping import pack_constructor
from remote_module._state_dict import merge_remote_state, select_prefixed
from remote_module._unsupported import UNSUPPORTED_METHODS, make_unsupported
from rpc_backend._torch_private import (
    device_map_to,
    is_jit_interface,
    is_rpc_initialized,
    dist_autograd_contexts_exist,
    register_rpc_reducer,
    rpc_serialize,
    worker_names,
)

#: torch.distributed.rpc's "use the agent's default timeout".
_AGENT_DEFAULT_TIMEOUT = -1.0


def _require_rpc(what: str) -> None:
    if not is_rpc_initialized():
        raise RuntimeError(_rpc_missing_message(what))


class RemoteModule(nn.Module):
    """A module created on a remote worker, called through RPC as if it were local.

    ``RemoteModule(remote_device, module_cls, args, kwargs)`` creates
    ``module_cls(*args, **kwargs)`` on the worker and device named by ``remote_device``
    (``"worker1/cuda:0"``, ``"rank:1/cpu"`` or ``"worker1"``, device cpu by default) and
    returns a proxy whose ``forward`` and ``forward_async`` have the module's real
    ``forward`` signature. ``forward`` blocks; ``forward_async`` returns a
    ``torch.futures.Future``. Both record distributed autograd when called inside a
    ``torch.distributed.autograd`` context. Arguments are bound on the caller, so a call
    with wrong arguments raises ``TypeError`` before anything is sent.

    In a model, the proxy is a leaf without local parameters or buffers: ``model.parameters()``
    lists the local ones (remote ones come from :meth:`remote_parameters`), ``model.to()``,
    ``cuda()``, ``half()`` and friends leave the remote module where ``remote_device`` put it,
    ``model.train()``/``eval()`` reach the host, and ``model.state_dict()`` /
    ``load_state_dict()`` include the remote entries (copied through the CPU).

    When the remote device is not the CPU, CPU tensors in the arguments (at any depth of
    lists, tuples and dicts) are moved to it on the host. Outputs come back as they are when
    the caller has a device map towards the host, otherwise every tensor in them comes back
    on the CPU.

    Example (two processes)::

        # worker0 (caller)
        import torch, torch.distributed.rpc as rpc
        from remote_module import RemoteModule
        rpc.init_rpc("worker0", rank=0, world_size=2)
        linear = RemoteModule("worker1/cpu", torch.nn.Linear, args=(20, 30))
        out = linear(torch.randn(128, 20))         # runs on worker1
        fut = linear.forward_async(torch.randn(4, 20))
        print(out.shape, fut.wait().shape)
        rpc.shutdown()

        # worker1 (host): only needs this package installed
        import torch.distributed.rpc as rpc
        rpc.init_rpc("worker1", rank=1, world_size=2)
        rpc.shutdown()

    Attributes (sent with the proxy over RPC, see ``remote_module.PICKLED_ATTRIBUTES``):
    ``on`` (host worker name), ``device`` (device string on the host), ``is_device_map_set``,
    ``is_scriptable``, ``module_rref``, ``module_interface_cls``, ``forward_signature``,
    ``remote_type`` (qualified class name of the remote module), ``remote_repr`` (its
    ``repr`` when the proxy was made), ``timeout``.

    Args:
        remote_device: where to create the module.
        module_cls: a class (or any callable) returning an ``nn.Module``.
        args, kwargs: constructor arguments for ``module_cls``.
        _module_interface_cls: a ``@torch.jit.interface`` class; when given, the module is
            scripted on the host and the proxy can be scripted with ``torch.jit.script``.
        timeout: seconds allowed for every RPC this proxy makes (None: the RPC agent's
            default). A call to a host that hangs or died fails within it.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        register_rpc_reducer(cls, reduce_proxy)  # the RPC pickler matches exact classes

    def __init__(
        self,
        remote_device: str,
        module_cls: Any,
        args: tuple | None = None,
        kwargs: dict[str, Any] | None = None,
        *,
        _module_interface_cls: Any = None,
        timeout: float | None = None,
    ) -> None:
        super().__init__()
        _require_rpc("RemoteModule(...)")
        args = _check_args(args)
        kwargs = _check_kwargs(kwargs)
        if not callable(module_cls):
            raise TypeError(
                f"module_cls must be an nn.Module class or a callable returning one, got {module_cls!r}"
            )
        self._prepare(remote_device, _module_interface_cls, timeout)
        where = f"on {self.on} while creating {getattr(module_cls, '__qualname__', module_cls)!r}"
        local_sig = forward_signature(module_cls) if isinstance(module_cls, type) else None
        # Classes the host cannot import (defined in __main__ or a function) go by value.
        module_cls, args, kwargs = pack_constructor(module_cls, args, kwargs)
        if _module_interface_cls is not None:
            render_scriptable_module(_module_interface_cls)  # caller side: validates the interface
            rref = self._rpc(
                _handlers._create_scripted_module, module_cls, args, kwargs, self.device, _module_interface_cls
            )
            if isinstance(rref, RemoteFailure):
                reraise(rref, where)
            self.module_rref = rref
        else:
            self.module_rref = self._call_or_explain(
                rpc.remote, _handlers._create_module, (module_cls, args, kwargs, self.device), "creating the module"
            )
        # Waits until the module exists on the host, so construction errors surface here and
        # the first forward can never race the creation.
        info = self._rpc(_handlers._describe, self.module_rref)
        if info["failure"] is not None:
            reraise(info["failure"], where)
        self._finish(info, local_sig)

    @staticmethod
    def init_from_module_rref(
        remote_device: str,
        module_rref: rpc.RRef,
        _module_interface_cls: Any = None,
        *,
        timeout: float | None = None,
    ) -> RemoteModule:
        """A second proxy for the module behind ``module_rref`` (shared, not copied).

        Also the way to hand a scriptable proxy to another worker: send
        ``proxy.get_module_rref()`` and call this on the receiver.

        Example::

            # on worker0
            a = RemoteModule("worker1/cpu", torch.nn.Linear, (4, 4))
            b = RemoteModule.init_from_module_rref("worker1/cpu", a.get_module_rref())
            assert torch.equal(a(x), b(x))   # same weights: one module on worker1
        """
        _require_rpc("RemoteModule.init_from_module_rref(...)")
        if not isinstance(module_rref, rpc.PyRRef):
            raise TypeError(f"module_rref must be an RRef of an nn.Module, got {type(module_rref).__name__}")
        proxy = RemoteModule.__new__(RemoteModule)
        nn.Module.__init__(proxy)
        proxy._prepare(remote_device, _module_interface_cls, timeout)
        owner = module_rref.owner_name()
        if proxy.on != owner:
            raise ValueError(
                f"remote_device {remote_device!r} names worker {proxy.on!r}, but module_rref is owned "
                f"by {owner!r}: pass '{owner}/<device>'"
            )
        if _module_interface_cls is not None:
            render_scriptable_module(_module_interface_cls)
            proxy._rpc(_handlers._prepare_scriptable, _module_interface_cls)
        proxy.module_rref = module_rref
        info = proxy._rpc(_handlers._describe, module_rref)
        if info["failure"] is not None:
            reraise(info["failure"], f"on {proxy.on} while creating the module behind module_rref")
        proxy._finish(info, None)
        return proxy

    # ---- construction helpers ------------------------------------------------------------

    def _prepare(self, remote_device: str, interface_cls: Any, timeout: float | None) -> None:
        parsed = parse_remote_device(remote_device)
        if interface_cls is not None and not is_jit_interface(interface_cls):
            raise ValueError(
                "_module_interface_cls must be a class decorated with @torch.jit.interface, "
                f"got {interface_cls!r}"
            )
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0
        ):
            raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
        self.timeout = _AGENT_DEFAULT_TIMEOUT if timeout is None else float(timeout)
        self.on = _worker_name(parsed.worker, remote_device)
        self.device = str(parsed.device)
        # A device map only matters for a module off the CPU (torch checks it the same way).
        self.is_device_map_set = parsed.device.type != "cpu" and bool(device_map_to(self.on))
        self.is_scriptable = interface_cls is not None
        self.module_interface_cls = interface_cls

    def _finish(self, info: dict, local_sig: inspect.Signature | None) -> None:
        self.remote_type = info["type"]
        self.module_key = info["key"]
        if local_sig is not None:
            # This proxy keeps the exact local objects; a picklable copy travels with it.
            self.forward_signature = _handlers.portable_signature(local_sig)
        else:
            self.forward_signature = info["signature"]
        self._install_generated_methods(local_sig)
        self.training = info["training"]
        self.remote_repr = info["repr"]
        check_attributes(self)

    def _install_generated_methods(self, sig: inspect.Signature | None = None) -> None:
        if self.is_scriptable:
            generated = render_scriptable_module(self.module_interface_cls)
            fwd, fwd_async = generated.forward, generated.forward_async
            fwd_async = torch.jit.export(fwd_async)
        else:
            origin = f"{self.remote_type}.forward"
            fwd, fwd_async = render_forward_methods(sig if sig is not None else self.forward_signature, origin)
        self.forward = types.MethodType(fwd, self)
        self.forward_async = types.MethodType(fwd_async, self)

    # ---- calls ---------------------------------------------------------------------------

    def _rpc(self, handler: Callable[..., Any], *args: Any) -> Any:
        """A blocking call of a host-side handler, with this proxy's timeout."""
        return self._call_or_explain(rpc.rpc_sync, handler, args, handler.__name__.lstrip("_"))

    def _call_or_explain(self, api: Callable[..., Any], handler: Callable[..., Any], args: tuple, what: str) -> Any:
        try:
            return api(self.on, handler, args, timeout=self.timeout)
        except RuntimeError as exc:
            raise self._failed(exc, what) from exc

    def _failed(self, exc: BaseException, what: str) -> BaseException:
        """An RPC-level failure (timeout, dead host, RPC shut down), naming worker and module."""
        if not is_rpc_initialized():
            return RuntimeError(_rpc_missing_message(f"RemoteModule on {self.on!r}: {what}"))
        remote_type = getattr(self, "remote_type", "the module")
        message = f"RemoteModule call to worker {self.on!r} ({remote_type}, {what}) failed: {exc}"
        try:
            return type(exc)(message)
        except Exception:
            return RuntimeError(message)

    def _where(self) -> str:
        return f"on {self.on} in {self.remote_type}.forward"

    def _explain_unsendable(self, args: tuple, kwargs: dict, exc: BaseException) -> BaseException | None:
        sig = self.forward_signature
        names = [] if sig is None else [
            p.name for p in sig.parameters.values()
            if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        ]
        found = unsendable_argument(args, kwargs, names, rpc_serialize)
        if found is None:
            return None
        name, why = found
        return TypeError(
            f"argument {name!r} of {self.remote_type}.forward cannot be sent over RPC to {self.on!r}: {why}. "
            "Pass tensors, plain Python values or picklable objects instead."
        )

    def _dest(self) -> Any:
        """The host's WorkerInfo, looked up once per process (a name costs a lookup per call)."""
        info = self.__dict__.get("_host_info")
        if info is None:
            info = self.__dict__["_host_info"] = rpc.get_worker_info(self.on)
        return info

    def _call_message(self, args: tuple, kwargs: dict) -> tuple:
        # Fast path (inlined small tensors) only where it is safe: no device map, and no
        # distributed autograd context that would need tensors on the wire to record.
        inline = not self.is_device_map_set and not dist_autograd_contexts_exist()
        if inline:
            args, kwargs = pack(args), pack(kwargs)
        # The user's arguments come first: if one cannot be pickled, nothing else was.
        return (args, kwargs, self.module_key, self.device, torch.is_grad_enabled(), inline, self.is_device_map_set)

    def _remote_call_sync(self, args: tuple, kwargs: dict) -> Any:
        """Used by the generated ``forward``."""
        message = self._call_message(args, kwargs)
        try:
            out = rpc.rpc_sync(self._dest(), _handlers._call, message, timeout=self.timeout)
        except (TypeError, AttributeError, pickle.PicklingError) as exc:
            raise (self._explain_unsendable(args, kwargs, exc) or exc) from exc
        except RuntimeError as exc:
            raise self._failed(exc, "forward") from exc
        if type(out) is RemoteFailure:
            reraise(out, self._where())
        return unpack(out) if message[5] else out

    def _remote_call_async(self, args: tuple, kwargs: dict) -> Future:
        """Used by the generated ``forward_async``."""
        message = self._call_message(args, kwargs)
        inline = message[5]
        try:
            fut = rpc.rpc_async(self._dest(), _handlers._call, message, timeout=self.timeout)
        except (TypeError, AttributeError, pickle.PicklingError) as exc:
            raise (self._explain_unsendable(args, kwargs, exc) or exc) from exc
        except RuntimeError as exc:
            raise self._failed(exc, "forward_async") from exc
        # A torch.futures.Future (rpc_async's is its C base class); on a device-mapped proxy it
        # carries the local devices, so CUDA stream ordering is kept across the hand-over.
        result: Future = Future(devices=self._future_devices()) if self.is_device_map_set else Future()

        def settle(done: Any) -> None:
            try:
                out = done.wait()
            except RuntimeError as exc:
                result.set_exception(self._failed(exc, "forward_async"))
                return
            except BaseException as exc:
                result.set_exception(exc)
                return
            if type(out) is RemoteFailure:
                result.set_exception(to_exception(out, self._where()))
            else:
                result.set_result(unpack(out) if inline else out)

        fut.add_done_callback(settle)
        return result

    def _future_devices(self) -> list[torch.device]:
        return sorted({torch.device(d) for d in device_map_to(self.on).values()}, key=str)

    # ---- public API ----------------------------------------------------------------------

    def remote_parameters(self, recurse: bool = True) -> list[rpc.RRef]:
        """RRefs of the remote module's parameters, e.g. for ``DistributedOptimizer``.

        Example::

            opt = DistributedOptimizer(torch.optim.SGD, proxy.remote_parameters(), lr=0.1)
        """
        return self._rpc(_handlers._param_rrefs, self.module_rref, recurse)

    def get_module_rref(self) -> rpc.RRef:
        """The ``RRef`` of the remote module (``RRef[nn.Module]``)."""
        return self.module_rref

    def train(self, mode: bool = True) -> RemoteModule:
        """Set the remote module's training mode (on the host) and return this proxy."""
        if not isinstance(mode, bool):
            raise ValueError(f"training mode is expected to be boolean, got {mode!r}")
        self._rpc(_handlers._train, self.module_rref, mode)
        self.training = mode
        return self

    def eval(self) -> RemoteModule:
        """Put the remote module in evaluation mode and return this proxy."""
        return self.train(False)

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """CPU copies of the remote module's state, under ``prefix`` (as ``nn.Module.state_dict``).

        A model holding this proxy gets the remote entries in its own ``state_dict()``.
        ``keep_vars`` has no effect: the values are always detached copies.

        Example::

            torch.save(model.state_dict(), "ckpt.pt")   # local and remote entries
        """
        if args:  # nn.Module's deprecated positional form: (destination, prefix, keep_vars)
            destination, prefix, keep_vars = (list(args) + [destination, prefix, keep_vars][len(args):])[:3]
        state, metadata = self._rpc(_handlers._state_dict, self.module_rref)
        return merge_remote_state(destination, prefix, state, metadata)

    def _load_from_state_dict(
        self,
        state_dict: dict,
        prefix: str,
        local_metadata: dict,
        strict: bool,
        missing_keys: list,
        unexpected_keys: list,
        error_msgs: list,
    ) -> None:
        # Called by nn.Module.load_state_dict for this proxy (directly or inside a model).
        state, metadata = select_prefixed(state_dict, prefix)
        missing, unexpected, errors = self._rpc(_handlers._load_state_dict, dict(state), metadata, self.module_rref)
        missing_keys.extend(prefix + k for k in missing)
        unexpected_keys.extend(prefix + k for k in unexpected)
        error_msgs.extend(errors)

    def __repr__(self) -> str:
        module = nn.modules.module._addindent(self.remote_repr, 2)
        return f"{type(self).__name__}(on={self.on}, device={self.device}, module={module})"

    def __getstate__(self) -> Any:
        raise RuntimeError(NOT_PICKLABLE)

    def __setstate__(self, state: Any) -> None:
        raise RuntimeError(NOT_UNPICKLABLE)


for _name in UNSUPPORTED_METHODS:
    setattr(RemoteModule, _name, make_unsupported(_name))
del _name

register_rpc_reducer(RemoteModule, reduce_proxy)
register_rpc_reducer(torch.jit.RecursiveScriptModule, reduce_script_module)


def _rpc_missing_message(what: str) -> str:
    return (
        f"{what} needs torch.distributed.rpc: call rpc.init_rpc(name, rank=..., world_size=...) "
        "(or rpc_backend.init_from_env() in a torchrun job) first, and use it before rpc.shutdown()."
    )


def _worker_name(worker: str | int, remote_device: str) -> str:
    try:
        return rpc.get_worker_info(worker).name
    except RuntimeError:
        known = worker_names()
        what = f"rank {worker}" if isinstance(worker, int) else f"worker {worker!r}"
        raise ValueError(
            f"remote_device {remote_device!r} names {what}, which is not in this RPC world "
            f"(workers: {', '.join(known)})"
        ) from None


def _check_args(args: Any) -> tuple:
    if args is None:
        return ()
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of constructor arguments, got {type(args).__name__}: {args!r}")
    return tuple(args)


def _check_kwargs(kwargs: Any) -> dict:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise TypeError(f"kwargs must be a dict of str to constructor arguments, got {kwargs!r}")
    return dict(kwargs)
