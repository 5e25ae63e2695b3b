"""The wire format of calls and answers: pickle itself, with small CPU tensors inline.

``dumps(obj, inline=...)`` pickles ``obj`` with one :class:`pickle.Pickler` subclass and
returns a :class:`Payload` ``(data, side)``: ``data`` is the pickle, ``side`` the objects
that torch RPC's own pickler must carry, which travel next to ``data`` inside the RPC
message (RPC pickles them: tensors through its tensor channel, RRefs with their fork
protocol). :func:`loads` is the receiver's side. Because the whole value is one pickle,
everything pickle keeps is kept: container types and subclasses (``defaultdict``, a list
subclass), self-references, identity (the same object twice arrives as one object).

Tensors. With ``inline=True`` a small dense CPU tensor (exact ``torch.Tensor``) is written
into ``data`` at the storage level: its storage bytes once per storage (so a tensor and its
views still share storage on arrival), plus offset, sizes, strides (channels_last and
transposes are kept), dtype and ``requires_grad``. torch RPC sends a compact copy of a view
whose storage is at least 8 KB and at least twice the view's bytes (measured on torch 2.13:
``big[:2048]`` of a 16 KB storage arrives with an 8 KB storage, ``big[:2049]`` with the full
16 KB, a 7 KB storage is always sent whole); inlining follows the same rule. Every other
tensor (big, CUDA, sparse, quantized, conjugate/negative views, subclasses such as
``nn.Parameter``), and every tensor when ``inline=False`` (distributed autograd records
only tensors that travel as tensors), goes to ``side``.

Other objects. Classes registered with the RPC pickler (``RemoteModule`` proxies, script
modules) are reduced with their registered reducer, as RPC would; RRefs go to ``side``.
Classes and functions that the receiver cannot import by name (defined in ``__main__`` or
inside a function) ship by value (:func:`remote_module._proxy.shipping.by_value_reduce`).

Example::

    payload = dumps(({"x": torch.ones(3)}, {}), inline=True)   # caller
    args, kwargs = loads(payload)                               # host
"""

from __future__ import annotations

import copyreg
import ctypes
import io
import pickle
import struct
import types
import weakref
from typing import Any, NamedTuple

import torch

from remote_module._core import rpc_class_reducers, rref_types
from remote_module._proxy.shipping import by_value_reduce

#: Tensors whose bytes on the wire are at most this are inlined; larger ones use the tensor
#: channel, which streams big buffers without extra copies.
INLINE_MAX_BYTES = 64 * 1024
#: torch RPC's compact-copy rule for views (see the module docstring).
COMPACT_MIN_STORAGE_BYTES = 8 * 1024
COMPACT_MIN_MULTIPLE = 2

_PROTOCOL = pickle.HIGHEST_PROTOCOL
_PLAIN, _TENSOR, _SIDE = 0, 1, 2  # how a type travels (cached per type in _kinds)
_kinds: dict[type, int] = {}
_by_reference: weakref.WeakSet = weakref.WeakSet()  # classes/functions known importable by name
_class_reducers = rpc_class_reducers()  # live dict: later registrations are seen


class Payload(NamedTuple):
    """A pickled value: ``data`` and the objects RPC itself must carry (``side``).

    ``data`` is a pickle (bytes starting with pickle's PROTO opcode), or one of two short forms
    for the commonest small calls, which skip the pickler but hold exactly what the pickle
    would (the same tensor records, so identity, views and storage sharing are kept): a lone
    tensor record (bytes starting with a record tag, never PROTO) for an output that is one
    inlined tensor, and a tuple of tensor records for ``(args, {})`` whose args are all inlined
    tensors.
    """

    data: bytes
    side: list


def _wire_kind(cls: type) -> int:
    kind = _kinds.get(cls)
    if kind is None:
        if issubclass(cls, torch.Tensor):
            kind = _TENSOR
        elif issubclass(cls, rref_types()):
            kind = _SIDE
        else:
            kind = _PLAIN
        _kinds[cls] = kind
    return kind


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


class _Tensors:
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


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, inline: bool, tensors: _Tensors | None = None) -> None:
        super().__init__(file, _PROTOCOL)
        self.inline = inline
        self.side: list = []
        self._side_index: dict[int, int] = {}
        self._records = tensors if tensors is not None else _Tensors()

    def persistent_id(self, obj: Any) -> Any:
        cls = type(obj)
        kind = _kinds.get(cls)
        if kind is None:
            kind = _wire_kind(cls)
        if kind == _PLAIN:
            return None
        if kind == _TENSOR and self.inline:
            pid = self._records.record(obj)
            if pid is not None:
                return pid
        index = self._side_index.get(id(obj))
        if index is None:
            index = self._side_index[id(obj)] = len(self.side)
            self.side.append(obj)
        return index  # an int: a side object

    def reducer_override(self, obj: Any) -> Any:
        reducer = _class_reducers.get(type(obj))
        if reducer is not None:
            return reducer(obj)
        if isinstance(obj, (type, types.FunctionType)):
            if obj in _by_reference:
                return NotImplemented
            reduced = by_value_reduce(obj)
            if reduced is None:
                try:
                    _by_reference.add(obj)
                except TypeError:
                    pass
                return NotImplemented
            return reduced
        return NotImplemented


class _Records:
    """Decodes tensor records (the receiver's side of :class:`_Tensors`)."""

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


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, side: list) -> None:
        super().__init__(file)
        self.side = side
        self.records = _Records()

    def persistent_load(self, pid: Any) -> Any:
        if type(pid) is int:
            return self.side[pid]
        return self.records.tensor(pid)


_PROTO_OPCODE = pickle.PROTO[0]  # every pickle of protocol >= 2 starts with it; records never


def _short_form(obj: Any) -> bytes | tuple | None:
    """The short ``data`` of :class:`Payload` for ``obj``, when it has one (see there)."""
    cls = type(obj)
    if cls is torch.Tensor:
        return _Tensors().record(obj)
    if cls is tuple and len(obj) == 2 and type(obj[1]) is dict and not obj[1] and type(obj[0]) is tuple:
        args = obj[0]
        if not args or any(type(a) is not torch.Tensor for a in args):
            return None
        tensors = _Tensors()
        records = tuple(tensors.record(a) for a in args)
        return None if None in records else records
    return None


def dumps(obj: Any, *, inline: bool) -> Payload:
    """Pickle ``obj`` for an RPC message (see the module docstring). Raises what pickling
    raises; nothing is sent."""
    if inline:
        short = _short_form(obj)
        if short is not None:
            return Payload(short, [])
    buf = io.BytesIO()
    pickler = _Pickler(buf, inline)
    pickler.dump(obj)
    return Payload(buf.getvalue(), pickler.side)


class _SideCheck(pickle.Pickler):
    """Pickles a side object as torch RPC's pickler will, writing no tensor or storage bytes
    (those always pickle) and no RRef (RPC's fork protocol)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, _PROTOCOL)
        # RPC's pickler matches its registered reducers by exact class, as a dispatch table does
        self.dispatch_table = {**copyreg.dispatch_table, **_class_reducers}

    def persistent_id(self, obj: Any) -> Any:
        cls = type(obj)
        if cls is torch.Tensor or issubclass(cls, _STORAGE_TYPES) or issubclass(cls, rref_types()):
            return 0
        return None


_STORAGE_TYPES = (torch.UntypedStorage, torch.TypedStorage)


def check_side(side: list) -> None:
    """Raise, on the caller, what torch RPC's pickler would raise for ``side`` (see
    :func:`dumps`) once the call is already under way: a tensor subclass whose
    ``__reduce_ex__`` fails, or whose class the pickler cannot name. Exact tensors and RRefs
    always pickle and are skipped; no tensor bytes are copied.

    Example::

        payload = dumps((args, kwargs), inline=False)
        check_side(payload.side)   # raises here, before anything is sent
    """
    for obj in side:
        if type(obj) is not torch.Tensor and isinstance(obj, torch.Tensor):
            _SideCheck(io.BytesIO()).dump(obj)


def loads(payload: Payload) -> Any:
    """The value :func:`dumps` pickled."""
    data = payload.data
    if type(data) is tuple:  # (args, {}) with args all inlined tensors
        records = _Records()
        return tuple([records.tensor(pid) for pid in data]), {}
    if data[0] != _PROTO_OPCODE:  # one inlined tensor
        return _Records().tensor(data)
    return _Unpickler(io.BytesIO(data), payload.side).load()
