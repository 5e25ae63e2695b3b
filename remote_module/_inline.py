"""Inlining small CPU tensors into the RPC message as plain bytes.

torch RPC sends every tensor through its tensor channel, and any tensor inside a Python RPC
value also makes RPC scan that value for tensors when the call completes; together they cost
~100 µs on a small call. Here a small dense CPU tensor travels as a :class:`Packed` record
(bytes, dtype, shape, requires_grad) that RPC sees as an ordinary Python object; the receiver
turns records back into tensors with :func:`unpack`. Used only where it is safe: the caller
checks that no distributed autograd context exists (recording needs real tensors on the wire)
and that no device map is set. The receiver gets a tensor with the same dtype, shape, values
and ``requires_grad`` flag as through the tensor channel.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from remote_module._walk import map_leaves, map_tensors

#: Tensors up to this many bytes are inlined; larger ones use the tensor channel, which
#: streams big buffers without extra copies.
INLINE_MAX_BYTES = 64 * 1024

_DTYPES = {str(d): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
)}


class Packed:
    """A tensor as bytes: pickles as a small plain object, never as a tensor."""

    __slots__ = ("data", "dtype", "shape", "requires_grad")

    def __init__(self, data: bytes, dtype: str, shape: tuple, requires_grad: bool) -> None:
        self.data = data
        self.dtype = dtype
        self.shape = shape
        self.requires_grad = requires_grad

    def __reduce__(self) -> tuple:
        return Packed, (self.data, self.dtype, self.shape, self.requires_grad)

    @staticmethod
    def of(tensor: torch.Tensor) -> Packed:
        t = tensor
        if not t.is_contiguous() or t.is_conj() or t.is_neg():
            t = t.detach().resolve_conj().resolve_neg().contiguous()
        # ctypes copies straight from the tensor's memory (cheaper than going through numpy)
        data = ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""
        return Packed(data, str(t.dtype), tuple(t.shape), tensor.requires_grad)

    def tensor(self) -> torch.Tensor:
        t = torch.empty(self.shape, dtype=_DTYPES[self.dtype])
        if self.data:
            # into memory the tensor owns (a tensor over a Python buffer would need the GIL
            # to be freed)
            ctypes.memmove(t.data_ptr(), self.data, len(self.data))
        if self.requires_grad:
            t.requires_grad_(True)
        return t


def inlinable(t: torch.Tensor) -> bool:
    """Small, dense, CPU, plain tensors of a supported dtype."""
    return (
        type(t) is torch.Tensor
        and t.device.type == "cpu"
        and t.layout is torch.strided
        and str(t.dtype) in _DTYPES
        and t.numel() * t.element_size() <= INLINE_MAX_BYTES
        and not t.is_quantized
    )


def pack(obj: Any) -> Any:
    """``obj`` with its inlinable tensors as :class:`Packed` (one record per tensor object, so
    aliasing between arguments survives)."""
    seen: dict[int, Any] = {}

    def wrap(t: torch.Tensor) -> Any:
        if not inlinable(t):
            return t
        p = seen.get(id(t))
        if p is None:
            p = seen[id(t)] = Packed.of(t)
        return p

    return map_tensors(wrap, obj)


def unpack(obj: Any) -> Any:
    """The receiver's side of :func:`pack`: records become tensors again."""
    seen: dict[int, torch.Tensor] = {}

    def rebuild(p: Packed) -> torch.Tensor:
        t = seen.get(id(p))
        if t is None:
            t = seen[id(p)] = p.tensor()
        return t

    return map_leaves(rebuild, obj, Packed)
