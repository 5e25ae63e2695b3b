"""How a RemoteModule proxy calls its host: ``forward``/``forward_async`` and the blocking
calls of other handlers, all keeping the call contract in README.md ("Calls: the call
contract", the one place it is written). Point 6 (arguments checked on the caller, only those
given sent) is the generated methods' (``remote_module._proxy.codegen``), point 7 (what
arrives is what was sent) ``remote_module._proxy.wire``'s.

``forward_async`` calls go through the proxy's :class:`remote_module._proxy.channel.Channel` (one
per proxy and process), which may let cheap calls share messages.

A mixin of :class:`remote_module.RemoteModule`; it reads the proxy's attributes ``on``,
``device``, ``is_device_map_set``, ``module_key``, ``module_rref``, ``remote_type``,
``forward_signature`` and ``timeout``, and keeps the per-process state that
:meth:`RemoteCalls._declare_process_state` declares.
"""

from __future__ import annotations

import inspect
import math
import threading
import time
import warnings
from typing import Any, Callable

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from remote_module._core import (
    CallTimeout,
    RemoteFailure,
    agent_timeout_seconds,
    check_peer,
    device_map_to,
    dist_autograd_contexts_exist,
    is_rpc_initialized,
    on_machine,
    parameters_as_views,
    peer_checked,
    records_outside_context,
    retyped,
    rpc_timeout_argument,
    timeout_message,
    to_exception,
    unsendable_argument,
    warn_untrained,
)
from remote_module._proxy import _host_calls
from remote_module._proxy.call_records import Answer, Call, Target
from remote_module._proxy.channel import Channel
from remote_module._proxy.wire import check_side, dumps, loads

_clock = time.monotonic
_channel_made = threading.Lock()  # two threads' first forward_async on one proxy keep one channel


def _rpc_missing_message(what: str) -> str:
    return (
        f"{what} needs torch.distributed.rpc: call rpc.init_rpc(name, rank=..., world_size=...) "
        "(or rpc_backend.init_from_env() in a torchrun job) first, and use it before rpc.shutdown()."
    )


def _label(on: str, remote_type: str, what: str) -> str:
    return f"RemoteModule call to worker {on!r} ({remote_type}, {what})"


def _failure(on: str, remote_type: str, exc: BaseException, what: str) -> BaseException:
    """An RPC-level failure (dead host, RPC shut down), naming worker and module."""
    if not is_rpc_initialized():
        return RuntimeError(_rpc_missing_message(f"RemoteModule on {on!r}: {what}"))
    return retyped(exc, f"{_label(on, remote_type, what)}{on_machine(on)} failed: {exc}")


class RemoteCalls:
    """The calling half of RemoteModule (see the module docstring)."""

    def _declare_process_state(self) -> None:
        """Declare what this proxy keeps for this process only: every way a proxy is built
        (the constructor, ``create_async``, ``init_from_module_rref``, ``copy.deepcopy``, arrival
        over RPC) calls this right after ``nn.Module.__init__``. None of it travels
        (``remote_module._proxy.pickling.IGNORED_ATTRIBUTES``)."""
        self._host_info: rpc.WorkerInfo | None = None  # the host's WorkerInfo, looked up on first use
        self._channel: Channel | None = None  # the forward_async channel, made on first use
        self._warned_untrained = False  # the one warning of training outside dist autograd (_core.untrained)
        self._warned_training_batch = False  # the one warning that a batching module in training mode joins nothing

    # ---- blocking calls --------------------------------------------------------------------

    def _rpc(self, handler: Callable[..., Any], *args: Any) -> Any:
        """A blocking call of a host-side handler, in program order, within this proxy's timeout."""
        return self._blocking(handler, args, handler.__name__.lstrip("_"), _clock())

    def _blocking(self, handler: Callable[..., Any], args: tuple, what: str, made: float) -> Any:
        timeout = self._timeout_s()
        deadline = made + timeout
        if not self._earlier_calls_done(deadline):
            raise CallTimeout(f"{_label(self.on, self._remote_type(), what)} failed: {timeout_message(timeout, None)}")
        try:
            return rpc.rpc_sync(self._dest(), handler, args, timeout=rpc_timeout_argument(deadline - _clock()))
        except RuntimeError as exc:
            if _clock() >= deadline - 0.05 and is_rpc_initialized():
                message = timeout_message(timeout, self.on)
                raise CallTimeout(f"{_label(self.on, self._remote_type(), what)} failed: {message}") from exc
            raise self._failed(exc, what) from exc

    def _earlier_calls_done(self, deadline: float) -> bool:
        """Wait until every call this thread made earlier on the proxy was answered; False when
        ``deadline`` (``time.monotonic()``) passed first. Layers that call the host by other
        means (a pipeline's stages) call it first, to keep program order."""
        channel = self._channel
        return channel is None or channel.wait_for_thread(deadline)

    def _failed(self, exc: BaseException, what: str) -> BaseException:
        return _failure(self.on, self._remote_type(), exc, what)

    def _remote_type(self) -> str:
        return getattr(self, "remote_type", "the module")

    def _timeout_s(self) -> float:
        """This proxy's timeout in seconds (``math.inf``: none)."""
        if self.timeout >= 0:  # checked seconds (0, as torch spells it: none)
            return self.timeout if self.timeout > 0 else math.inf
        try:  # negative: the agent's default
            return agent_timeout_seconds()
        except RuntimeError as exc:  # no agent (before init_rpc, after shutdown): torch's
            # own message here says nothing of what to do
            raise RuntimeError(_rpc_missing_message(f"RemoteModule on {self.on!r}")) from exc

    def _where(self) -> str:
        return f"on {self.on} in {self.remote_type}.forward"

    def _dest(self) -> Any:
        """The host's WorkerInfo, looked up once per process (a name costs a lookup per call),
        and its build checked at every call until it is known to be this one (a set lookup
        then): a proxy shipped here may be the first contact, and a first call on an RPC
        handler thread does not wait for the answer (rpc_backend/builds.py)."""
        info = self._host_info
        if info is None:
            try:
                info = rpc.get_worker_info(self.on)
            except RuntimeError as exc:  # no agent (after shutdown): say what to do instead
                raise RuntimeError(_rpc_missing_message(f"RemoteModule on {self.on!r}")) from exc
            self._host_info = info
        if not peer_checked(info.name):
            check_peer(info.name, self._timeout_s())
        return info

    # ---- forward ---------------------------------------------------------------------------

    def _fast_path_allowed(self) -> bool:
        # Inlined tensors and shared messages only where it is safe: no device map, and no
        # distributed autograd context that would need tensors on the wire to record.
        return not self.is_device_map_set and not dist_autograd_contexts_exist()

    def _target(self) -> Target:
        # A scripted module has no Python object that lives as long as it does (its RRef holds
        # the TorchScript object), so a scriptable proxy names it by its RRef, as torch's does.
        key = self.module_rref if self.is_scriptable else self.module_key
        return Target(key, self.device, self.is_device_map_set)

    def _make_call(self, args: tuple, kwargs: dict) -> Call:
        inline = self._fast_path_allowed()
        if not inline and dist_autograd_contexts_exist():
            # torch RPC would send a parameter detached: a view of it travels in the graph
            args, kwargs = parameters_as_views((args, kwargs))
        try:
            payload = dumps((args, kwargs), inline=inline)
            if payload.side:  # what RPC's own pickler will carry must not fail once sent
                check_side(payload.side)
        except Exception as exc:  # pickling happens here: nothing was sent
            raise self._explain_unsendable(args, kwargs, exc, inline) from exc
        # after the checks: a call refused before anything is sent does not use up the one warning
        if records_outside_context(self, self.remote_trainable, args, kwargs):
            warn_untrained(self, f"RemoteModule on worker {self.on!r} ({self.remote_type})", "proxy", "proxy")
        grad = torch.is_grad_enabled()
        if self.batching is not None and not grad and not self._warned_training_batch:
            self._warned_training_batch = True
            # the flag as this proxy last saw it (made, described, train()/eval(), a read of
            # .training): asking the host would block an async call behind earlier ones
            if self.__dict__.get("training"):
                warnings.warn(
                    f"RemoteModule on {self.on!r} ({self.remote_type}) batches calls only in eval mode, and was in "
                    "training mode when this proxy last looked (nn.Module's default): its no-grad calls each run "
                    "alone, with dropout and batch norm acting as in training. Call .eval() on it (or the model "
                    "holding it) to serve.",
                    UserWarning, stacklevel=4)
        # (inline: no distributed autograd context in this process, so none to keep apart)
        return Call(payload, grad, inline, not grad and (inline or not dist_autograd_contexts_exist()))

    def _explain_unsendable(self, args: tuple, kwargs: dict, exc: BaseException, inline: bool) -> TypeError:
        """The ``TypeError`` for arguments that cannot be pickled, naming the first such
        parameter as the module's ``forward`` does (the generated methods send the given
        positional arguments in parameter order, then the ``*args`` extras)."""
        sig = self.forward_signature
        names: list[str] = []
        var_positional = "args"
        for p in () if sig is None else sig.parameters.values():
            if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
                names.append(p.name)
            elif p.kind is inspect.Parameter.VAR_POSITIONAL:
                var_positional = p.name

        def serialize(value: Any) -> None:
            check_side(dumps(value, inline=inline).side)

        found = unsendable_argument(args, kwargs, names, serialize, var_positional)
        if found is None:
            return TypeError(
                f"the arguments of {self.remote_type}.forward cannot be sent over RPC to {self.on!r}: "
                f"{type(exc).__name__}: {exc}. Pass tensors, plain Python values or picklable objects instead."
            )
        name, why = found
        return TypeError(
            f"argument {name!r} of {self.remote_type}.forward cannot be sent over RPC to {self.on!r}: "
            f"{type(why).__name__}: {why}. Pass tensors, plain Python values or picklable objects instead."
        )

    def _remote_call_sync(self, args: tuple, kwargs: dict) -> Any:
        """Used by the generated ``forward``."""
        self._sync_requires_grad()
        made = _clock()
        call = self._make_call(args, kwargs)
        sent = (self._target().wire(), call.wire())
        answer = Answer.from_wire(self._blocking(self._forward_handlers()[0], sent, "forward", made))
        channel = self._channel
        if channel is not None:
            channel.observe(answer.seconds)
        return self._forward_result(answer.result)

    def _remote_call_async(self, args: tuple, kwargs: dict) -> Future:
        """Used by the generated ``forward_async``."""
        self._sync_requires_grad()
        made = _clock()
        call = self._make_call(args, kwargs)
        batchable = call.inline and not call.payload.side
        return self._call_channel().submit(call.wire(), timeout=self._timeout_s(), batchable=batchable, made=made)

    def _attempt(self, args: tuple, kwargs: dict, timeout_s: float) -> Future:
        """One ``forward`` call sent in one RPC of its own (no channel, no ordering with this
        proxy's other calls), for a layer that chooses among hosts (``remote_module.serving``).
        The Future's value is ``(output, None)``, or ``(None, exception)`` when the module (or
        the pickling of its arguments or output) raised on the host: the call's own answer. An
        error of the Future itself means no answer came: the host is gone or was late beyond
        ``timeout_s``. Arguments that cannot be sent raise here, and nothing is sent."""
        call = self._make_call(args, kwargs)
        sent = rpc.rpc_async(self._dest(), self._forward_handlers()[0], (self._target().wire(), call.wire()),
                             timeout=rpc_timeout_argument(timeout_s))
        out: Future = Future()

        def answered(fut: Future) -> None:
            try:
                result = Answer.from_wire(fut.wait()).result
            except BaseException as exc:  # no answer: RPC's own error, as it is
                out.set_exception(exc)
                return
            try:  # (the module's failure, or an output this process cannot unpickle: the call's own)
                value = self._forward_result(result)
            except Exception as exc:
                out.set_result((None, exc))
                return
            out.set_result((value, None))

        sent.add_done_callback(answered)
        return out

    def _forward_handlers(self) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """The host handlers of this proxy's ``forward`` calls: one call, several in a message
        (those that let the host join calls into batches when the module batches)."""
        if self.batching is None:
            return _host_calls._call_one, _host_calls._call_many
        return _host_calls._call_one_joining, _host_calls._call_many_joining

    def _forward_result(self, result: Any) -> Any:
        if type(result) is RemoteFailure:
            raise to_exception(result, self._where()) from None
        return loads(result)

    def _call_channel(self) -> Channel:
        """This proxy's channel, made on first use in this process (never pickled)."""
        channel = self._channel
        if channel is None:
            on, remote_type, where = self.on, self.remote_type, self._where()

            def finish(result: Any) -> Any:  # holds no reference to the proxy
                if type(result) is RemoteFailure:
                    raise to_exception(result, where)
                return loads(result)

            def fail(exc: BaseException) -> BaseException:
                return _failure(on, remote_type, exc, "forward_async") if isinstance(exc, RuntimeError) else exc

            one, many = self._forward_handlers()
            channel = Channel(
                self._dest(), one, many, self._target().wire(),
                finish=finish, fail=fail, label=_label(on, remote_type, "forward_async"),
                devices=self._future_devices() if self.is_device_map_set else None,
                keepalive=self.module_rref,
            )
            with _channel_made:  # of two threads making one at once, the first keeps its channel
                if self._channel is None:
                    self._channel = channel
                channel = self._channel
        return channel

    def _future_devices(self) -> list[torch.device]:
        return sorted({torch.device(d) for d in device_map_to(self.on).values()}, key=str)


