"""Small CPU tensors written into a message's pickle as bytes ("records"), not sent through
torch RPC's tensor channel.

On TensorPipe every tensor in a message is a separate transfer with its own descriptor; for a
tensor of a few hundred bytes that costs more than the rest of a small call (measured: a
4 x 16 float tensor added ~80 us of CPU per message on the ``uv`` transport). A record is the
tensor's storage bytes plus offset, sizes, strides, dtype and ``requires_grad``, so what
arrives is what was sent. torch RPC sends a compact copy of a view whose storage is at least
8 KB and at least twice the view's bytes (measured on torch 2.13: ``big[:2048]`` of a 16 KB
storage arrives with an 8 KB storage, ``big[:2049]`` with the full 16 KB, a 7 KB storage is
always sent whole); records follow the same rule.

Used by the proxy's wire format (``remote_module._proxy.wire``, which also keeps identity and
shared storages across one value) and, through :func:`inline_small`, by the layers that send
tensors they made themselves (a ``LocalModule``'s per-rank inputs).

Only where nothing needs the tensor to travel as a tensor: distributed autograd records only
tensors sent through the channel, and a device map moves only those.

Example::

    sent = inline_small(torch.ones(3))     # pickles as bytes; unpickles as the tensor
"""

from __future__ import annotations

import ctypes
import struct
from typing import Any

import torch

#: Tensors whose bytes on the wire are at most this are inlined; larger ones use the tensor
#: channel, which streams big buffers without extra copies.
INLINE_MAX_BYTES = 64 * 1024
#: torch RPC's compact-copy rule for views (see the module docstring).
COMPACT_MIN_STORAGE_BYTES = 8 * 1024
COMPACT_MIN_MULTIPLE = 2


_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
)
_DTYPE_CODES = {d: i for i, d in enumerate(_DTYPES)}
# An inlined tensor is one persistent id of bytes (one object: the pickler visits nothing
# inside it): header (tag, dtype, requires_grad, ndim, storage index, offset), sizes, strides,
# then, the first time a storage is seen, its bytes.
_HEADER = struct.Struct("<BBBBqq")
_NEW_STORAGE, _SEEN_STORAGE, _SEEN_TENSOR = 1, 2, 3
_SEEN = struct.Struct("<Bq")


def _sent_tensor(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor whose storage goes inline for ``t`` (``t`` or its compact copy), or None
    when ``t`` must travel through the tensor channel."""
    if (
        type(t) is not torch.Tensor
        or not t.is_cpu
        or t.layout is not torch.strided
        or t.dtype not in _DTYPE_CODES
        or t.is_conj()
        or t.is_neg()
    ):
        return None
    nbytes = t.untyped_storage().nbytes()
    if nbytes >= COMPACT_MIN_STORAGE_BYTES:
        useful = t.numel() * t.element_size()
        if nbytes >= COMPACT_MIN_MULTIPLE * useful:  # what torch RPC sends is a compact copy
            if useful > INLINE_MAX_BYTES:
                return None
            return t.detach().clone()
        if nbytes > INLINE_MAX_BYTES:
            return None
    return t


class TensorRecords:
    """Encodes inlined tensors as records, remembering tensors and storages already written
    within one value (so identity survives and views share their storage on arrival)."""

    __slots__ = ("_tensors", "_storages", "_new_storages", "_keep")

    def __init__(self) -> None:
        self._tensors: dict[int, int] = {}  # id(tensor) -> index, so identity survives
        self._storages: dict[int, int] = {}  # data_ptr -> index, so views share storage
        self._new_storages = 0
        self._keep: list = []  # compact copies stay alive: their addresses must stay unique

    def record(self, t: torch.Tensor) -> bytes | None:
        """The record of ``t``, or None when it must travel through the tensor channel."""
        index = self._tensors.get(id(t))
        if index is not None:
            return _SEEN.pack(_SEEN_TENSOR, index)
        sent = _sent_tensor(t)
        if sent is None:
            return None
        if sent is not t:
            self._keep.append(sent)
        self._tensors[id(t)] = len(self._tensors)
        storage = sent.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        shape = sent.shape
        ndim = len(shape)
        sizes = struct.pack(f"<{2 * ndim}q", *shape, *sent.stride())
        code = _DTYPE_CODES[sent.dtype]
        seen = self._storages.get(ptr) if nbytes else None
        if seen is not None:
            return _HEADER.pack(_SEEN_STORAGE, code, t.requires_grad, ndim, seen, sent.storage_offset()) + sizes
        index = self._new_storages
        self._new_storages += 1
        if nbytes:  # empty storages may share an address; each is its own
            self._storages[ptr] = index
        header = _HEADER.pack(_NEW_STORAGE, code, t.requires_grad, ndim, index, sent.storage_offset())
        return header + sizes + (ctypes.string_at(ptr, nbytes) if nbytes else b"")


class RecordReader:
    """Decodes tensor records (the receiver's side of :class:`TensorRecords`)."""

    __slots__ = ("tensors", "storages")

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.storages: list[torch.UntypedStorage] = []

    def tensor(self, pid: bytes) -> torch.Tensor:
        if pid[0] == _SEEN_TENSOR:
            return self.tensors[_SEEN.unpack(pid)[1]]
        tag, code, requires_grad, ndim, index, offset = _HEADER.unpack_from(pid)
        end = _HEADER.size + 16 * ndim
        sizes = struct.unpack_from(f"<{2 * ndim}q", pid, _HEADER.size)
        if tag == _NEW_STORAGE:
            nbytes = len(pid) - end
            storage = torch.UntypedStorage(nbytes)
            if nbytes:
                # into memory the storage owns (one over the message's buffer would keep the
                # whole message alive)
                ctypes.memmove(storage.data_ptr(), pid[end:], nbytes)
            self.storages.append(storage)
        else:
            storage = self.storages[index]
        t = torch.empty(0, dtype=_DTYPES[code]).set_(storage, offset, sizes[:ndim], sizes[ndim:])
        if requires_grad:
            t.requires_grad_(True)
        self.tensors.append(t)
        return t


class InlineTensor:
    """A tensor that pickles as its record and unpickles as the tensor (see the module
    docstring); made by :func:`inline_small`."""

    __slots__ = ("record",)

    def __init__(self, record: bytes) -> None:
        self.record = record

    def __reduce__(self) -> tuple:
        return _from_record, (self.record,)


def _from_record(record: bytes) -> torch.Tensor:
    return RecordReader().tensor(record)


def inline_small(t: torch.Tensor) -> Any:
    """``t`` as an :class:`InlineTensor` when it can travel as a record (an exact dense CPU
    tensor of a plain dtype, at most :data:`INLINE_MAX_BYTES` on the wire), else ``t``."""
    record = TensorRecords().record(t)
    return t if record is None else InlineTensor(record)
