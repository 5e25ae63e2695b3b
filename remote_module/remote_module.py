"""``RemoteModule``: a local ``nn.Module`` proxy for a module that lives on another worker."""

from __future__ import annotations

import copy
import inspect
import types
import warnings
from typing import Any, Callable

import torch
import torch.distributed.rpc as rpc
from torch import nn
from torch.futures import Future

from remote_module._core import (
    is_jit_interface,
    is_rpc_initialized,
    parse_remote_device,
    register_rpc_reducer,
    retyped,
    worker_names,
)
from remote_module._proxy import _host
from remote_module._proxy.batching import BatchPolicy, checked_policy
from remote_module._proxy.calls import RemoteCalls, _rpc_missing_message
from remote_module._proxy.codegen import render_forward_methods, render_scriptable_module
from remote_module._proxy.creation import AGENT_DEFAULT_TIMEOUT as _AGENT_DEFAULT_TIMEOUT
from remote_module._proxy.creation import check_constructor_arguments, create_on_host
from remote_module._proxy.idioms import HANDLE, RequiresGradHandle, dtype_casts, install_handle
from remote_module._proxy.module_state import RemoteModuleState
from remote_module._proxy.pickling import (
    PICKLED_ATTRIBUTES,
    check_attributes,
    check_declared_attributes,
    device_map_is_set,
    pickled_attributes,
    reduce_proxy,
    reduce_script_module,
)
from remote_module._proxy.unsupported import UNSUPPORTED_METHODS, make_unsupported
from rpc_backend.options import positive_seconds


def _require_rpc(what: str) -> None:
    if not is_rpc_initialized():
        raise RuntimeError(_rpc_missing_message(what))


class RemoteModule(RemoteCalls, RemoteModuleState, nn.Module):
    """A module created on a remote worker, called through RPC as if it were local.

    ``RemoteModule(remote_device, module_cls, args, kwargs)`` creates
    ``module_cls(*args, **kwargs)`` on the worker and device named by ``remote_device``
    (``"worker1/cuda:0"``, ``"rank:1/cpu"`` or ``"worker1"``, device cpu by default) and
    returns a proxy whose ``forward`` and ``forward_async`` have the module's real
    ``forward`` signature. ``forward`` blocks; ``forward_async`` returns a
    ``torch.futures.Future``. Both record distributed autograd when called inside a
    ``torch.distributed.autograd`` context. Arguments are checked against the signature on
    the caller, so a call with wrong arguments (or an argument that cannot be pickled, named
    by its parameter) raises ``TypeError`` before anything is sent. Only the arguments given
    travel: defaults are evaluated on the host by the module's own ``forward``, as in a
    local call (a sentinel default is the host's own object, a large default tensor is
    never sent).

    In a model, the proxy is a leaf without local buffers whose one local parameter is a
    zero-element handle, ``remote_requires_grad`` (remote parameters come from
    :meth:`remote_parameters`): ``model.requires_grad_(flag)`` reaches the handle and sets the
    flag on the remote module's parameters on the host (as does ``proxy.requires_grad_(flag)``;
    ``p.requires_grad = flag`` over ``model.parameters()`` applies at the next forward).
    ``model.double()``, ``half()``, ``to(dtype)``, ``type(dtype)`` and friends cast the remote
    module on its host as they cast a local module; moves (``model.to("cuda")``, ``cuda()``)
    leave it where ``remote_device`` put it. ``copy.deepcopy(model)`` copies the remote module
    on its host (see ``remote_module._proxy.idioms``). ``model.train()``/``eval()`` reach the
    host (``proxy.training`` asks it, so every proxy of one module agrees),
    ``model.state_dict()`` / ``load_state_dict()`` include the remote entries (copied through
    the CPU; ``assign=True`` applies on the host), and ``DistributedDataParallel(model)`` syncs
    the local parameters (the proxy lists none when asked alone, as DDP asks; the handle never
    gets a gradient).

    When the remote device is not the CPU, CPU tensors in the arguments (at any depth of
    lists, tuples and dicts) are moved to it on the host. Outputs come back as they are when
    the caller has a device map towards the host, otherwise every tensor in them comes back
    on the CPU.

    Example (two processes)::

        # worker0 (caller); make_options(): the transport that sleeps when idle (torch's
        # default options busy-poll a core per process)
        import torch, torch.distributed.rpc as rpc
        from remote_module import RemoteModule
        from rpc_backend import make_options
        rpc.init_rpc("worker0", rank=0, world_size=2, rpc_backend_options=make_options())
        linear = RemoteModule("worker1/cpu", torch.nn.Linear, args=(20, 30))
        out = linear(torch.randn(128, 20))         # runs on worker1
        fut = linear.forward_async(torch.randn(4, 20))
        print(out.shape, fut.wait().shape)
        rpc.shutdown()

        # worker1 (host): only needs this package installed
        import torch.distributed.rpc as rpc
        from rpc_backend import make_options
        rpc.init_rpc("worker1", rank=1, world_size=2, rpc_backend_options=make_options())
        rpc.shutdown()

    Every call, whatever path it takes, keeps the call contract in README.md ("Calls: the
    call contract").

    Creating a proxy is one message to the host; :meth:`create_async` returns a Future of the
    proxy instead of waiting, so many proxies (shards, pipeline stages) are created at once.

    Attributes (sent with the proxy over RPC: ``RemoteModule.PICKLED_ATTRIBUTES``, which is
    ``remote_module.PICKLED_ATTRIBUTES``; a subclass whose extra per-proxy state must travel
    declares ``PICKLED_ATTRIBUTES = RemoteModule.PICKLED_ATTRIBUTES + ("extra",)``):
    ``on`` (host worker name), ``device`` (device string on the host), ``is_device_map_set``
    (whether this process has a device map towards the host, for a module off the CPU; worked
    out again wherever the proxy arrives), ``is_scriptable``, ``module_rref``,
    ``module_interface_cls``, ``forward_signature``, ``remote_type`` (qualified class name of
    the remote module), ``remote_repr`` (its ``repr`` when the proxy was made),
    ``remote_trainable`` (whether the remote module has parameters that require grad, as this
    proxy last saw: when it was made or its ``requires_grad_`` last ran), ``timeout``.

    Training: outside a ``dist_autograd.context()`` nothing is recorded across RPC, so
    ``loss.backward()`` never reaches the remote parameters (nor the inputs sent). A forward
    that records gradients there (grad mode on, and ``remote_trainable`` or an input requiring
    grad) warns once per proxy with a ``UserWarning`` saying what to do; it is silent under
    ``torch.no_grad()``, inside a context, and for a frozen module given inputs without grad.

    Args:
        remote_device: where to create the module.
        module_cls: a class (or any callable) returning an ``nn.Module``.
        args, kwargs: constructor arguments for ``module_cls``.
        _module_interface_cls: a ``@torch.jit.interface`` class; when given, the module is
            scripted on the host and the proxy can be scripted with ``torch.jit.script``.
            Called from Python, such a proxy keeps the same call contract as any other.
            Inside TorchScript only what TorchScript can express holds: each call is one
            ``rpc_async`` bounded by ``timeout``, but a failure (an exception in ``forward``,
            a timeout) is TorchScript's ``RuntimeError`` carrying the host's message, and
            script calls are not ordered with the Python proxy's own calls.
        timeout: seconds allowed for every RPC this proxy makes (None: the RPC agent's
            default). A call to a host that hangs or died fails within it.
    """

    #: ``training`` is a property that asks the host: TorchScript must not compile it (it reads
    #: the last value seen, kept in ``__dict__``, as the scripted proxy's own flag).
    __jit_unused_properties__ = ["training"]

    #: What this process keeps for itself (:meth:`_declare_process_state`): not part of a
    #: scripted proxy either.
    __jit_ignored_attributes__ = ["_host_info", "_channel", "_warned_untrained", "_warned_training_batch"]

    #: The RRef of the remote module: None until the proxy is connected to it (while it is
    #: being built; ``nn.Module.__init__`` sets ``training`` before anything else is set), then
    #: the instance's own attribute, which travels with it (``PICKLED_ATTRIBUTES``).
    module_rref = None

    #: The :class:`~remote_module.BatchPolicy` under which the host joins this module's
    #: concurrent calls (``batching=``; see ``remote_module._proxy.batching``), None when it
    #: does not; the instance's own attribute when set, which travels with it.
    batching: BatchPolicy | None = None

    #: The attributes sent when a proxy travels over RPC (``remote_module.PICKLED_ATTRIBUTES``).
    #: A subclass with more per-proxy state that must travel extends it:
    #: ``PICKLED_ATTRIBUTES = RemoteModule.PICKLED_ATTRIBUTES + ("extra",)``.
    PICKLED_ATTRIBUTES: tuple[str, ...] = PICKLED_ATTRIBUTES

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_declared_attributes(cls)
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
        batching: BatchPolicy | None = None,
    ) -> None:
        super().__init__()
        self._declare_process_state()
        _require_rpc("RemoteModule(...)")
        # The same single message as create_async; waiting here means construction errors
        # surface here and the first forward can never race the creation.
        self._create(remote_device, module_cls, args, kwargs, _module_interface_cls, timeout, batching).wait()

    @classmethod
    def create_async(
        cls,
        remote_device: str,
        module_cls: Any,
        args: tuple | None = None,
        kwargs: dict[str, Any] | None = None,
        **options: Any,
    ) -> Future:
        """Start creating a proxy; a ``torch.futures.Future`` of it, ready to call.

        Takes what the constructor takes (``options``: ``timeout=``, ``_module_interface_cls=``)
        and sends the same single message, without waiting: N proxies (shards, pipeline
        stages) made one after another cost about one round trip in all. Bad arguments raise
        here; what the host raises (the module's constructor, a timeout) fails the future, with
        its original type, naming the worker. The proxy is an instance of ``cls`` set up as
        ``RemoteModule.__init__`` does; a subclass's own ``__init__`` does not run.

        Example (worker0; worker1 and worker2 only serve)::

            futures = [RemoteModule.create_async(f"worker{r}/cpu", torch.nn.Linear, (8, 8)) for r in (1, 2)]
            stages = [f.wait() for f in futures]        # both created concurrently
            out = stages[1](stages[0](torch.randn(4, 8)))
        """
        _require_rpc("RemoteModule.create_async(...)")
        unknown = sorted(set(options) - {"timeout", "_module_interface_cls", "batching"})
        if unknown:
            raise TypeError(
                f"create_async got unknown options {unknown}: it takes the constructor's keyword "
                "options, timeout=, batching= and _module_interface_cls="
            )
        proxy = cls.__new__(cls)
        nn.Module.__init__(proxy)
        proxy._declare_process_state()
        return proxy._create(
            remote_device, module_cls, args, kwargs, options.get("_module_interface_cls"), options.get("timeout"),
            options.get("batching"),
        )

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
        ``proxy.get_module_rref()`` and call this on the receiver. The proxy always calls the
        RRef's owner: a ``remote_device`` naming another worker is accepted, as torch does,
        with a ``UserWarning`` (``proxy.on`` names the owner).

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
        proxy._declare_process_state()
        proxy._prepare(remote_device, _module_interface_cls, timeout)
        owner = module_rref.owner_name()
        if proxy.on != owner:
            # torch accepts this (its calls reach the module through the RRef's owner) and existing
            # code relies on it: the proxy names, and calls, the owner.
            warnings.warn(
                f"remote_device {remote_device!r} names worker {proxy.on!r}, but module_rref is owned by "
                f"{owner!r}: this RemoteModule calls {owner!r} (proxy.on == {owner!r}). Pass "
                f"'{owner}/{proxy.device}' to say so.",
                UserWarning,
                stacklevel=2,
            )
            proxy._prepare(f"{owner}/{proxy.device}", _module_interface_cls, timeout)
        if _module_interface_cls is not None:
            render_scriptable_module(_module_interface_cls)
            proxy._rpc(_host._prepare_scriptable, _module_interface_cls)
        proxy.module_rref = module_rref
        proxy._finish(proxy._rpc(_host._describe, module_rref), None)
        return proxy

    # ---- construction helpers ------------------------------------------------------------

    def _create(
        self,
        remote_device: str,
        module_cls: Any,
        args: Any,
        kwargs: Any,
        interface_cls: Any,
        timeout: float | None,
        batching: Any = None,
    ) -> Future:
        """Check the arguments and send the one creation message; a Future of ``self``, ready."""
        args, kwargs = check_constructor_arguments(module_cls, args, kwargs)
        batching = checked_policy(batching)
        if batching is not None and interface_cls is not None:
            raise ValueError("batching is for a plain module: a scriptable proxy (_module_interface_cls) cannot batch")
        self._prepare(remote_device, interface_cls, timeout)
        if batching is not None:
            self.batching = batching
        return create_on_host(self, module_cls, args, kwargs)

    def _prepare(self, remote_device: str, interface_cls: Any, timeout: float | None) -> None:
        parsed = parse_remote_device(remote_device)
        if interface_cls is not None and not is_jit_interface(interface_cls):
            raise ValueError(
                "_module_interface_cls must be a class decorated with @torch.jit.interface, "
                f"got {interface_cls!r}"
            )
        self.timeout = _AGENT_DEFAULT_TIMEOUT if timeout is None else positive_seconds(timeout, "timeout")
        self.on = _host_worker_name(parsed.worker, remote_device)
        self.device = str(parsed.device)
        # A device map only matters for a module off the CPU (torch checks it the same way).
        self.is_device_map_set = device_map_is_set(self.on, self.device)
        self.is_scriptable = interface_cls is not None
        self.module_interface_cls = interface_cls

    def _finish(self, info: dict, local_sig: inspect.Signature | None) -> None:
        self.remote_type = info["type"]
        self.module_key = info["key"]
        if local_sig is not None:
            # This proxy keeps the exact local objects; a picklable copy travels with it.
            self.forward_signature = _host.portable_signature(local_sig)
        else:
            self.forward_signature = info["signature"]
        self._install_generated_methods(local_sig)
        self.remote_repr = info["repr"]
        self.remote_trainable = bool(info["trainable"])
        self.__dict__["training"] = bool(info.get("training", True))  # (the host's flag: last value seen)
        if info.get("batching") is not None:
            self.batching = info["batching"]
        install_handle(self, self.remote_trainable)
        check_attributes(self)

    def batching_stats(self) -> dict | None:
        """What the host's batcher of this module did so far (None when it does not batch): the
        forwards of joined calls and the calls they answered, the calls that queued and ran
        alone, those run again alone after a joined forward raised, did not split or failed its
        check, the calls that could not join, and the kinds of calls checked and refused (see
        ``remote_module._proxy.batching``). A blocking call, in program order."""
        return self._rpc(_host._batching_stats, self.module_rref)

    def _set_remote_requires_grad(self, requires_grad: bool) -> None:
        """``requires_grad_(requires_grad)`` of the module on its host; ``remote_trainable`` and
        the handle's flag as they are now (see ``remote_module._proxy.idioms``)."""
        if not isinstance(requires_grad, bool):
            raise TypeError(f"requires_grad must be a bool, got {requires_grad!r}")
        self.remote_trainable = self._rpc(_host._set_requires_grad, self.module_rref, requires_grad)
        handle = self._parameters.get(HANDLE)
        if handle is not None:
            handle.requires_grad = self.remote_trainable

    def _sync_requires_grad(self) -> None:
        """Apply on the host a flag set on the handle as an attribute (``p.requires_grad = flag``
        over ``model.parameters()``), which no method of the proxy saw (one message, only then)."""
        handle = self._parameters.get(HANDLE)
        if handle is not None and handle.requires_grad != self.remote_trainable:
            self._set_remote_requires_grad(handle.requires_grad)

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

    # ---- torch idioms: freezing, casting, copying (remote_module._proxy.idioms) ------------

    def requires_grad_(self, requires_grad: bool = True) -> RemoteModule:
        """Set ``requires_grad`` of every parameter of the remote module, on its host (as
        ``nn.Module.requires_grad_`` does a local module's), and return this proxy. A model
        holding the proxy reaches it the same way: ``model.requires_grad_(False)``.

        Example::

            proxy.requires_grad_(False)    # a frozen remote feature extractor
        """
        self._set_remote_requires_grad(requires_grad)
        return self

    def _apply(self, fn: Callable[[torch.Tensor], Any], recurse: bool = True) -> RemoteModule:
        # Called by a model's to()/double()/half()/type()/cuda()...: the casts fn makes reach the
        # remote module on its host; device moves stay here (the handle follows them).
        handle = self._parameters.get(HANDLE)
        casts = dtype_casts(fn, handle.device if handle is not None else torch.device("cpu"))
        if casts and self.module_rref is not None:
            self._rpc(_host._cast, self.module_rref, casts)
        super()._apply(fn, recurse)
        applied = self._parameters.get(HANDLE)
        if applied is not None and not isinstance(applied, RequiresGradHandle):
            install_handle(self, applied.requires_grad, like=applied)  # torch made a plain Parameter
        return self

    def __deepcopy__(self, memo: dict) -> RemoteModule:
        """A proxy of a copy of the remote module, made on its host: ``copy.deepcopy(model)``
        copies a model holding proxies as it copies a local model (an early-stopping snapshot).
        Proxies of one remote module inside the copied object share one copy. (``AveragedModel``
        averages ``model.parameters()``, where a proxy has only its handle: it does not average
        the remote weights; see tutorials/remote-module.md.)
        """
        self._sync_requires_grad()
        which = id(self.module_rref) if self.module_key is None else self.module_key  # scriptable: by RRef
        key = ("remote_module.RemoteModule copy of", self.on, which)
        made = memo.get(key)
        if made is None:
            try:
                made = self._rpc(_host._deepcopy, self.module_rref, self.module_interface_cls)
            except Exception as exc:
                raise retyped(
                    exc,
                    f"copy.deepcopy of a RemoteModule copies its module ({self.remote_type}) on its host "
                    f"{self.on!r}, as a local deepcopy copies a local module; that copy failed there: "
                    f"{type(exc).__name__}: {exc}. Keep model.state_dict() as a snapshot instead, or make "
                    f"{self.remote_type} deep-copyable.",
                ) from exc
            memo[key] = made
        info, rref = made
        clone = type(self).__new__(type(self))
        nn.Module.__init__(clone)
        clone._declare_process_state()
        memo[id(self)] = clone
        own = {"module_rref", "module_key", "remote_type", "remote_repr", "remote_trainable"}
        shared = {"forward_signature", "module_interface_cls"}  # the class's, as in a local copy
        sent = pickled_attributes(type(self))
        for name, value in list(vars(self).items()):  # what would travel over RPC, less its own
            if name in sent and name not in own:
                object.__setattr__(clone, name, value if name in shared else copy.deepcopy(value, memo))
        clone.module_rref = rref
        clone.module_key = info["key"]
        clone.remote_type = info["type"]
        clone.remote_repr = info["repr"]
        clone.remote_trainable = bool(info["trainable"])
        clone._install_generated_methods()
        install_handle(clone, clone.remote_trainable, like=self._parameters.get(HANDLE))
        check_attributes(clone)
        return clone

    # ---- public API ----------------------------------------------------------------------

    def remote_parameters(self, recurse: bool = True) -> list[rpc.RRef]:
        """RRefs of the remote module's parameters, e.g. for ``DistributedOptimizer``.

        Example::

            from torch.distributed.optim import DistributedOptimizer

            opt = DistributedOptimizer(torch.optim.SGD, proxy.remote_parameters(), lr=0.1)
        """
        return self._rpc(_host._param_rrefs, self.module_rref, recurse)

    def get_module_rref(self) -> rpc.RRef:
        """The ``RRef`` of the remote module (``RRef[nn.Module]``).

        Example::

            rref = proxy.get_module_rref()
            rref.rpc_sync().extra_repr()      # call any method on the host
        """
        return self.module_rref

    def __repr__(self) -> str:
        module = self.remote_repr.replace("\n", "\n  ")  # indent a multi-line module repr
        return f"{type(self).__name__}(on={self.on}, device={self.device}, module={module})"

    # Exported, so that a scripted proxy refuses torch.save / torch.jit.save with the same
    # message (TorchScript's pickler calls a script object's __getstate__). TorchScript compiles
    # them, so the messages are literals (TorchScript cannot read a global string): they equal
    # remote_module._proxy.pickling.NOT_PICKLABLE / NOT_UNPICKLABLE (tests/proxy/test_pickling.py checks).
    @torch.jit.export
    def __getstate__(self):  # noqa: ANN204
        raise RuntimeError(
            "Cannot pickle RemoteModule in python pickler. RemoteModule can only be pickled when using RPC"
            " (as an argument or result of an RPC call, where it stays a handle to the module on its host). "
            "torch.save(model) or pickle of a model holding one would save that handle, not the module's "
            "weights, and no later process could use it: save model.state_dict() instead (it holds copies of "
            "the remote module's parameters and buffers) and load it into a model built the same way with "
            "model.load_state_dict()."
        )

    @torch.jit.export
    def __setstate__(self, state):  # noqa: ANN001, ANN204
        raise RuntimeError(
            "Cannot unpickle RemoteModule in python pickler. RemoteModule can only be unpickled when using RPC"
        )


for _name in UNSUPPORTED_METHODS:
    setattr(RemoteModule, _name, make_unsupported(_name))
del _name

register_rpc_reducer(RemoteModule, reduce_proxy)
# Replaces torch's own reducer when torch.distributed.nn was imported first: same behaviour,
# but our message also says what to do instead.
register_rpc_reducer(torch.jit.RecursiveScriptModule, reduce_script_module, replace=True)


def _host_worker_name(worker: str | int, remote_device: str) -> str:
    try:
        return rpc.get_worker_info(worker).name
    except RuntimeError:
        known = worker_names()
        what = f"rank {worker}" if isinstance(worker, int) else f"worker {worker!r}"
        raise ValueError(
            f"remote_device {remote_device!r} names {what}, which is not in this RPC world "
            f"(workers: {', '.join(known)})"
        ) from None

