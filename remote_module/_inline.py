"""Inlining small CPU tensors into the RPC message itself.

torch RPC sends every tensor through its tensor channel, which costs a fixed ~180 µs on a
small call. A tensor that is on the CPU, dense and small travels just as well as bytes inside
the pickled message. This is used only where it is safe: the caller checks that no
distributed autograd context exists (recording needs real tensors on the wire) and that no
device map is set; the receiver gets an ordinary tensor with the same dtype, shape, values
and ``requires_grad`` flag as the tensor channel would have given.
"""

from __future__ import annotations

from typing import Any

import torch

from remote_module._device import map_tensors

#: Tensors up to this many bytes are inlined; larger ones use the tensor channel, which
#: streams big buffers without extra copies.
INLINE_MAX_BYTES = 64 * 1024

_DTYPES = {str(d): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
)}


def _rebuild(data: bytes, dtype: str, shape: tuple, requires_grad: bool) -> torch.Tensor:
    dt = _DTYPES[dtype]
    if not data:
        t = torch.empty(shape, dtype=dt)
    else:
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dt).reshape(shape)
    if requires_grad:
        t.requires_grad_(True)
    return t


class _Inline:
    """Pickles as bytes; unpickles as a plain tensor (via :func:`_rebuild`)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __reduce__(self) -> tuple:
        t = self.tensor.detach().resolve_conj().resolve_neg().contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return _rebuild, (data, str(t.dtype), tuple(t.shape), self.tensor.requires_grad)


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
    """``obj`` with its inlinable tensors wrapped (the same tensor object: one wrapper)."""
    seen: dict[int, Any] = {}

    def wrap(t: torch.Tensor) -> Any:
        if not inlinable(t):
            return t
        w = seen.get(id(t))
        if w is None:
            w = seen[id(t)] = _Inline(t)
        return w

    return map_tensors(wrap, obj)
