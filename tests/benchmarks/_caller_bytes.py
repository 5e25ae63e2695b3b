"""Counting what passes through the caller: every ``rpc_async``/``rpc_sync``/``remote`` the
calling process makes while a :class:`CallerBytes` is active, its arguments when sent and its
answer when it arrives (background threads' sends, such as the shard releaser's, included).

Measured, not computed: the arguments and answers are the very objects handed to and
returned by torch.distributed.rpc, sized as RPC would send them: every tensor by the bytes of
its storage (RPC sends a tensor's whole storage) and the rest by the length of its pickle
(with tensors and RRefs left out of it). RPC's and TensorPipe's own framing is not counted.
A tensor that remote_module's wire format writes into the pickle (64 KiB or less, see
remote_module/_proxy/wire.py) is counted in the pickled bytes, not as a tensor.
Tensors are also filed by shape, so a report can say which of them were activations.

Example (in the caller only)::

    with CallerBytes() as counted:
        model(x)
    counted.tensor_bytes("sent"), counted.messages
"""

from __future__ import annotations

import collections
import io
import pickle
import threading
from typing import Any

import torch
import torch.distributed.rpc as rpc


class _Sizer(pickle.Pickler):
    """Pickles an object with its tensors (collected) and RRefs left out."""

    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            self.tensors.append(obj)
            return ("tensor", len(self.tensors))
        if isinstance(obj, (rpc.PyRRef, torch.futures.Future)):
            return ("ref", id(obj))
        return None


def _walk(obj: Any, out: list[torch.Tensor], depth: int = 0) -> None:
    """Tensors inside ``obj`` (containers, attributes), for what does not pickle here."""
    if depth > 20:
        return
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _walk(v, out, depth + 1)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            _walk(v, out, depth + 1)
    elif hasattr(obj, "__dict__"):
        _walk(vars(obj), out, depth + 1)


def sized(obj: Any) -> tuple[int, list[torch.Tensor]]:
    """``(pickled bytes of everything but tensors, the tensors)``; -1 where it does not pickle."""
    tensors: list[torch.Tensor] = []
    buf = io.BytesIO()
    try:
        _Sizer(buf, tensors).dump(obj)
        return buf.tell(), tensors
    except Exception:
        tensors = []
        _walk(obj, tensors)
        return -1, tensors


def storage_bytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except Exception:
        return t.numel() * t.element_size()


def _handler_name(func: Any, args: Any) -> str:
    name = getattr(func, "__name__", repr(func))
    if isinstance(args, (tuple, list)) and args and callable(args[0]) and hasattr(args[0], "__name__"):
        name += f"({args[0].__name__})"  # remote_module._core.fanout runs the handler passed first
    return name


class CallerBytes:
    """While active (``with``), counts the caller's RPC traffic: ``messages`` by handler,
    ``tensors[(direction, shape)]`` bytes, ``other[direction]`` pickled bytes."""

    _PATCHED = ("rpc_async", "rpc_sync", "remote")

    def __init__(self, ignore: tuple = ()) -> None:
        self._ignore = ignore  # handlers whose calls are the measurement's own (not counted)
        self._lock = threading.Lock()
        self.messages: collections.Counter = collections.Counter()
        self.tensors: collections.Counter = collections.Counter()
        self.other: collections.Counter = collections.Counter()
        self.unpicklable = 0
        self._saved: dict[str, Any] = {}

    def _count(self, direction: str, obj: Any) -> None:
        nbytes, tensors = sized(obj)
        with self._lock:
            if nbytes < 0:
                self.unpicklable += 1
            else:
                self.other[direction] += nbytes
            for t in tensors:
                self.tensors[(direction, tuple(t.shape))] += storage_bytes(t)

    def _answered(self, fut: Any) -> None:
        try:
            value = fut.value()
        except Exception:
            return
        self._count("received", value)

    def _wrap(self, name: str, original: Any) -> Any:
        def counted(to: Any, func: Any, args: Any = None, kwargs: Any = None, *rest: Any, **kw: Any) -> Any:
            if func in self._ignore:
                return original(to, func, args, kwargs, *rest, **kw)
            with self._lock:
                self.messages[_handler_name(func, args)] += 1
            self._count("sent", (args, kwargs))
            result = original(to, func, args, kwargs, *rest, **kw)
            if name == "rpc_async":
                result.add_done_callback(self._answered)
            elif name == "rpc_sync":
                self._count("received", result)
            return result

        return counted

    def __enter__(self) -> "CallerBytes":
        for name in self._PATCHED:
            self._saved[name] = getattr(rpc, name)
            setattr(rpc, name, self._wrap(name, self._saved[name]))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._saved.items():
            setattr(rpc, name, original)
        self._saved.clear()

    def tensor_bytes(self, direction: str, shape_filter: Any = None) -> int:
        """Bytes of tensors that went ``direction`` ("sent"/"received"), those whose shape
        passes ``shape_filter`` where given."""
        with self._lock:
            return sum(
                n for (d, shape), n in self.tensors.items()
                if d == direction and (shape_filter is None or shape_filter(shape))
            )
