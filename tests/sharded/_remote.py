"""Functions and modules the sharded tests run on the workers (importable there)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from remote_module.sharded import _host, mesh_rank, mesh_size


def arange_plus_rank() -> torch.Tensor:
    """The seed's input shard: arange(0, 10) + rank, as float."""
    return torch.arange(0, 10, dtype=torch.float32) + mesh_rank()


class MaskedMean(nn.Module):
    """The seed's module: rank 0 keeps positions 1..2, rank 1 positions 4..6; sum(x) / mask.sum()."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros_like(x)
        if mesh_rank() == 0:
            mask[1:3] = 1
        else:
            mask[4:7] = 1
        return (x * mask).sum() / mask.sum()


def position() -> torch.Tensor:
    return torch.tensor([mesh_rank(), mesh_size()])


def held_count() -> int:
    """How many shards this process holds (for leak checks)."""
    from remote_module.sharded import _host

    return len(_host._store)


class ColumnParallel(nn.Module):
    """A column-parallel shard: ``relu(x @ W_r.T + b_r)`` with this rank's output columns."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


# ---- tests/sharded/test_over_rpc.py, tests/sharded/test_errors.py ----------------------------------

import time  # noqa: E402

from tests.proxy._remote import UserError  # noqa: E402


def full_rows(width: int, *, scale: float = 1.0) -> torch.Tensor:
    """A from_local shard made from args/kwargs and the mesh position: ``rank + 1`` rows of
    ``width`` columns, each ``(rank + size) * scale``."""
    return torch.full((mesh_rank() + 1, width), (mesh_rank() + mesh_size()) * scale)


def global_of(shape: tuple) -> torch.Tensor:
    """A deterministic global tensor of ``shape`` with distinct, signed values."""
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float32).reshape(shape) * 1.5 - 7.0)


def make_local(kind: str, dim: int, rank: int, size: int, shape: tuple) -> torch.Tensor:
    """Rank ``rank``'s local tensor of a sharded ``global_of(shape)`` under placement ``kind``
    ("shard" on ``dim``, "replicate"), or for "partial" distinct per-rank values where each rank
    wins some elements (so sum/avg/max/min all differ)."""
    g = global_of(shape)
    if kind == "shard":
        return torch.tensor_split(g, size, dim=dim)[rank].clone()
    if kind == "replicate":
        return g
    return g * (-1.0) ** rank + rank


def local_of(kind: str, dim: int, shape: tuple) -> torch.Tensor:
    """from_local's function for :func:`make_local`."""
    return make_local(kind, dim, mesh_rank(), mesh_size(), shape)


def different_shapes(shapes: list) -> torch.Tensor:
    """Rank r's shard has shape ``shapes[r]``."""
    return torch.zeros(shapes[mesh_rank()])


def int_shard() -> torch.Tensor:
    return torch.arange(4) + mesh_rank()


def not_a_tensor() -> int:
    return 3


def call_mesh_rank() -> int:
    """mesh_rank() on a worker, outside any shard."""
    return mesh_rank()


# ---- counting which process runs the shard-store handlers -----------------------------------

_traffic: list = []
_traffic_lock = __import__("threading").Lock()
_WATCHED = ("_fetch", "_piece", "_keep")


def _recording(name: str, original):
    def handler(*args, **kwargs):
        # _fetch(sid, dest) / _piece(sid, src, dst, rank, size, dest): the process that asked
        dest = args[-1] if name in ("_fetch", "_piece") else None
        with _traffic_lock:
            _traffic.append((name, dest))
        return original(*args, **kwargs)

    # pickled by reference as remote_module.sharded._host.<name>, so peers call this one too
    handler.__module__, handler.__qualname__, handler.__name__ = original.__module__, original.__qualname__, name
    handler.original = original
    return handler


def watch_store(on: bool) -> None:
    """Make this process's shard-store handlers record ``(handler, requesting worker)`` (or stop)."""
    from remote_module.sharded import _host

    for name in _WATCHED:
        current = getattr(_host, name)
        original = getattr(current, "original", current)
        setattr(_host, name, _recording(name, original) if on else original)
    with _traffic_lock:
        _traffic.clear()


def store_traffic() -> list:
    """What the watched handlers served here since the last call (then forgets it)."""
    with _traffic_lock:
        out = list(_traffic)
        _traffic.clear()
    return out


# ---- shard modules ------------------------------------------------------------------------


class Structured(nn.Module):
    """Returns ``x`` shaped as ``kind`` says: a tensor, a tuple, or nested tuple/list."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x: torch.Tensor):
        if self.kind == "tensor":
            return x + 1
        if self.kind == "tuple":
            return (x + 1, x * 2)
        return (x + 1, (x * 2, [x * 3, x - 1]))


class Mixed(nn.Module):
    """Several inputs: ``x @ w * scale + y + offset + z``."""

    def forward(self, x, w, scale, y, *, offset, z):
        if not isinstance(scale, float):
            raise TypeError(f"scale arrived as {type(scale).__name__}")
        return x @ w * scale + y + offset + z


def mixed_reference(x, w, scale, y, offset, z):
    return x @ w * scale + y + offset + z


class Echo(nn.Module):
    """Returns a copy of its input (what the shard received)."""

    def forward(self, x):
        return x.clone()


class Received(nn.Module):
    """What the shard received, as one row: ``[contiguous, requires_grad, storage offset,
    storage bytes, element bytes, dtype is float64]``."""

    def forward(self, x):
        return torch.tensor([[float(x.is_contiguous()), float(x.requires_grad), float(x.storage_offset()),
                              float(x.untyped_storage().nbytes()), float(x.numel() * x.element_size()),
                              float(x.dtype == torch.float64)]])


class Stamped(nn.Module):
    """Records its host's wall-clock start and end around a hold on the gate ``key`` (released
    by the test, tests._faults.gates): ``[start, end]``."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key

    def forward(self, x):
        from tests._faults import gates

        start = time.time()
        gates.hold(self.key)
        return torch.tensor([[start, time.time()]], dtype=torch.float64)


class Positioned(nn.Module):
    """``[mesh_rank(), mesh_size(), training]`` seen inside forward."""

    def forward(self, x):
        return torch.tensor([[float(mesh_rank()), float(mesh_size()), float(self.training)]])


class Filled(nn.Module):
    """Built per rank: a parameter of ``width`` copies of ``value``."""

    def __init__(self, value: float, *, width: int) -> None:
        super().__init__()
        self.value = nn.Parameter(torch.full((width,), float(value)))

    def forward(self, x):
        return self.value.detach().clone().unsqueeze(0)


class FailOnRank(nn.Module):
    """Raises UserError on mesh rank ``rank``; the others return their input."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def forward(self, x):
        if mesh_rank() == self.rank:
            raise UserError(f"shard {mesh_rank()} refuses")
        return x + 1


class Returns(nn.Module):
    """Returns what ``kind`` says, to break the output checks: "two" (a pair), "per-rank"
    (a tuple on rank 0, a list elsewhere), "two-on-last" (a pair on the last rank only),
    "int" (a tensor and an int), "scalar" (a 0-d tensor), "1d" (a 1-d tensor), "rank-shapes"
    (rank r: shape (2, r + 1))."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x):
        k, r = self.kind, mesh_rank()
        if k == "two":
            return x, x
        if k == "per-rank":
            return (x, x) if r == 0 else [x, x]
        if k == "two-on-last":
            return (x, x) if r == mesh_size() - 1 else x
        if k == "int":
            return x, 3
        if k == "1d":
            return torch.ones(3)
        if k == "rank-shapes":
            return torch.ones(2, r + 1)
        raise ValueError(k)


class SumNested(nn.Module):
    """Adds the tensors of a nested argument: ``{"a": [x, (y,)]}`` -> ``x + y``."""

    def forward(self, nested: dict, *, extra: list) -> torch.Tensor:
        return nested["a"][0] + nested["a"][1][0] + extra[0]


class Pair(NamedTuple):
    a: Any
    b: Any


class SumPair(nn.Module):
    """Adds the two tensors of a named tuple."""

    def forward(self, pair: Pair) -> torch.Tensor:
        return pair.a + pair.b


# ---- tests/sharded/test_over_rpc.py, used as an ordinary user would --------------------


class Affine(nn.Module):
    """``x @ W.T`` with the same ``W`` on every worker (a replicated parameter)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


def storage_bytes(sid: tuple) -> int:
    """Bytes of the storage behind shard ``sid`` here (a view keeps its whole storage alive)."""
    return _host._store.get(tuple(sid)).untyped_storage().nbytes()

