"""How a RemoteModule proxy calls its host: the ``forward`` path (fast or recording) and
the blocking calls of other handlers, with timeouts and errors that name worker and module.

A mixin of :class:`remote_module.RemoteModule`; it reads the proxy's attributes ``on``,
``device``, ``is_device_map_set``, ``module_key``, ``module_rref``, ``remote_type``,
``forward_signature`` and ``timeout``.
"""

from __future__ import annotations

import inspect
import pickle
from typing import Any, Callable

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from remote_module import _call_handlers
from remote_module._errors import RemoteFailure, reraise, to_exception, unsendable_argument
from remote_module._inline import pack, unpack
from remote_module._pipeline import pipeline_of
from remote_module._torch_private import device_map_to, dist_autograd_contexts_exist, is_rpc_initialized, rpc_serialize


def _rpc_missing_message(what: str) -> str:
    return (
        f"{what} needs torch.distributed.rpc: call rpc.init_rpc(name, rank=..., world_size=...) "
        "(or rpc_backend.init_from_env() in a torchrun job) first, and use it before rpc.shutdown()."
    )



class RemoteCalls:
    """The calling half of RemoteModule (see the module docstring)."""

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

    def _fast_path_allowed(self) -> bool:
        # Inlined tensors and pipelining only where it is safe: no device map, and no
        # distributed autograd context that would need tensors on the wire to record.
        return not self.is_device_map_set and not dist_autograd_contexts_exist()

    def _call_message(self, args: tuple, kwargs: dict) -> tuple:
        inline = self._fast_path_allowed()
        if inline:
            args, kwargs = pack(args), pack(kwargs)
        # The user's arguments come first: if one cannot be pickled, nothing else was.
        return (args, kwargs, self.module_key, self.device, torch.is_grad_enabled(), inline, self.is_device_map_set)

    def _send_call(self, api: Callable[..., Any], args: tuple, kwargs: dict, what: str) -> tuple[Any, bool]:
        """Send one ``forward`` call with ``api`` (rpc_sync or rpc_async); (answer, inlined)."""
        message = self._call_message(args, kwargs)
        try:
            return api(self._dest(), _call_handlers._call, message, timeout=self.timeout), message[5]
        except (TypeError, AttributeError, pickle.PicklingError) as exc:
            raise (self._explain_unsendable(args, kwargs, exc) or exc) from exc
        except RuntimeError as exc:
            raise self._failed(exc, what) from exc

    def _remote_call_sync(self, args: tuple, kwargs: dict) -> Any:
        """Used by the generated ``forward``."""
        out, inline = self._send_call(rpc.rpc_sync, args, kwargs, "forward")
        if type(out) is RemoteFailure:
            reraise(out, self._where())
        return unpack(out) if inline else out

    def _remote_call_async(self, args: tuple, kwargs: dict) -> Future:
        """Used by the generated ``forward_async``."""
        if self._fast_path_allowed():
            pipelined = pipeline_of(self).try_submit(args, kwargs)
            if pipelined is not None:
                return pipelined
        fut, inline = self._send_call(rpc.rpc_async, args, kwargs, "forward_async")
        # A torch.futures.Future (rpc_async's is its C base class); on a device-mapped proxy it
        # carries the local devices, so CUDA stream ordering is kept across the hand-over.
        result: Future = Future(devices=self._future_devices()) if self.is_device_map_set else Future()

        def settle(done: Any) -> None:
            try:
                out = done.wait()
            except BaseException as exc:
                result.set_exception(self._async_failure(exc))
                return
            self._settle(result, out, inline)

        fut.add_done_callback(settle)
        return result

    def _settle(self, result: Future, out: Any, inline: bool) -> None:
        """Complete ``result`` with one host answer: its output, or its exception."""
        if type(out) is RemoteFailure:
            result.set_exception(to_exception(out, self._where()))
        else:
            result.set_result(unpack(out) if inline else out)

    def _async_failure(self, exc: BaseException) -> BaseException:
        """What an async call's future carries when the RPC itself failed."""
        return self._failed(exc, "forward_async") if isinstance(exc, RuntimeError) else exc

    def _future_devices(self) -> list[torch.device]:
        return sorted({torch.device(d) for d in device_map_to(self.on).values()}, key=str)
