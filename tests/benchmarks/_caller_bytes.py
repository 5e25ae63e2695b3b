"""Counting what passes through the caller: every ``rpc_async``/``rpc_sync``/``remote`` the
calling process makes while a :class:`CallerBytes` is active, its arguments when sent and its
answer when it arrives (background threads' sends, such as the shard releaser's, included).

Measured, not computed: the arguments and answers are the very objects handed to and
returned by torch.distributed.rpc, sized as RPC would send them, by the rules of
``rpc_backend.Traffic`` (rpc_backend/traffic.py): every tensor by the bytes RPC sends for it
(its whole storage, or a compact copy of a small view of a big one) and the rest by the length
of its pickle (with tensors and RRefs left out of it). RPC's and TensorPipe's own framing is not
counted. What this adds to Traffic: the messages by handler and the tensors filed by shape.
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
import threading
from typing import Any

import torch.distributed.rpc as rpc

from rpc_backend.traffic import payload_parts, tensor_wire_bytes

#: the sizing rules of rpc_backend.Traffic (one rule for every byte count here)
sized = payload_parts
storage_bytes = tensor_wire_bytes


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
