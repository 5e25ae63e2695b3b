"""Carrying exceptions from the host back to the caller faithfully.

Host-side handlers catch what the user's code raises and return a :class:`RemoteFailure`
record (plain strings: it always unpickles on the caller). The caller re-raises it with the
original type when that type is importable there, else as a :class:`RemoteModuleError`
subclass named after the original. The message starts with the original message, then names
the worker and the module class, then shows the remote traceback.
"""

from __future__ import annotations

import builtins
import importlib
import traceback
from dataclasses import dataclass
from typing import Any

from remote_module._core._torch_private import jit_exception_origin
from rpc_backend.watch import machine_of


class RemoteModuleError(RuntimeError):
    """An exception raised on a remote worker whose type is not importable on the caller."""

    remote_type: str = ""


@dataclass(frozen=True)
class RemoteFailure:
    """What a host-side handler returns instead of raising (see :func:`capture`)."""

    type_module: str
    type_qualname: str
    message: str
    traceback: str


def capture(exc: BaseException) -> RemoteFailure:
    """Host side: describe ``exc`` (any ``BaseException``, e.g. ``SystemExit`` raised by one
    call) with its traceback, in strings only.

    An exception raised inside TorchScript code (a scripted module) reaches Python as
    ``torch.jit.Error``; it is described by the type and message the script raised (e.g.
    ``ValueError``), with TorchScript's own traceback kept in ``traceback``.
    """
    cls = type(exc)
    tb = "".join(traceback.format_exception(cls, exc, exc.__traceback__))
    origin = jit_exception_origin(exc)
    if origin is not None:
        class_name, message = origin
        module, _, qualname = class_name.rpartition(".")
        return RemoteFailure(module or "builtins", qualname, message, tb)
    return RemoteFailure(cls.__module__, cls.__qualname__, str(exc), tb)


def _resolve_type(module: str, qualname: str) -> type | None:
    try:
        obj: Any = builtins if module == "builtins" else importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except Exception:
        return None
    return obj if isinstance(obj, type) and issubclass(obj, BaseException) else None


_fallback_types: dict[str, type] = {}


def _fallback_type(full_name: str) -> type:
    cls = _fallback_types.get(full_name)
    if cls is None:
        short = full_name.rsplit(".", 1)[-1]
        cls = type(short, (RemoteModuleError,), {"remote_type": full_name, "__module__": __name__})
        _fallback_types[full_name] = cls
    return cls


def to_exception(failure: RemoteFailure, where: str) -> BaseException:
    """Caller side: the exception to raise for ``failure``; ``where`` names worker and module."""
    full_name = f"{failure.type_module}.{failure.type_qualname}"
    text = f"{failure.message}\n\n[raised {where}]\nRemote traceback:\n{failure.traceback}"
    cls = _resolve_type(failure.type_module, failure.type_qualname)
    # SystemExit, KeyboardInterrupt and the like raised on the host must not stop the caller:
    # they arrive as RemoteModuleError subclasses named after them.
    if cls is not None and issubclass(cls, Exception):
        try:
            exc = cls(text)
            if isinstance(exc, cls):
                return exc
        except Exception:
            pass  # a constructor that does not take one message: fall back below
    return _fallback_type(full_name)(f"{full_name}: {text}")


class CallTimeout(RuntimeError):
    """A call that got no answer within its timeout (its message says whether it was sent)."""


def timeout_message(seconds: float, sent_to: str | None) -> str:
    """Why a call timed out: still queued on the caller, or sent and unanswered."""
    if sent_to is None:
        return (
            f"timed out after {seconds:g} s before it was sent (timeout={seconds:g} s): earlier calls on "
            "this proxy were still queued or running"
        )
    return f"sent to worker {sent_to!r}, no answer within {seconds:g} s (timeout={seconds:g} s)"


def on_machine(worker: str) -> str:
    """``" on machine1 (10.42.0.2, torchrun group rank 1)"`` when ``worker`` runs on another
    machine than this rank, as its last heartbeat said (rpc_backend.watch.machine_of); else
    ``""``. For failures of a broken connection, which say nothing of where the peer was."""
    where = machine_of(worker)
    return f" on {where}" if where else ""


def retyped(exc: BaseException, message: str) -> BaseException:
    """``exc``'s type with ``message`` (a ``RuntimeError`` when that type will not take one
    string), for RPC-level failures reported with the worker and call they concern.

    Example::

        >>> retyped(ValueError("eof"), "call to worker1 failed: eof")
        ValueError('call to worker1 failed: eof')
    """
    try:
        new = type(exc)(message)
        if isinstance(new, type(exc)):
            return new
    except Exception:
        pass
    return RuntimeError(message)


def unsendable_argument(
    args: tuple, kwargs: dict, param_names: list[str], serialize: Any, var_positional: str = "args"
) -> tuple[str, BaseException] | None:
    """The first argument that ``serialize`` rejects, by parameter name, with its error.

    ``param_names`` names the positional parameters in order; extra positional arguments
    are named ``<var_positional>[j]`` (``rest[0]`` for ``forward(self, x, *rest)``). Returns
    None when every argument serializes on its own.

    Example::

        >>> unsendable_argument((1, len), {}, ["x", "fn"], lambda v: v + 0)[0]
        'fn'
    """
    for i, value in enumerate(args):
        try:
            serialize(value)
        except Exception as exc:
            name = param_names[i] if i < len(param_names) else f"{var_positional}[{i - len(param_names)}]"
            return name, exc
    for name, value in kwargs.items():
        try:
            serialize(value)
        except Exception as exc:
            return name, exc
    return None
