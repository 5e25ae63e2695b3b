"""Host side of tests/proxy/test_batching_hostile.py (module level: RPC runs these by reference)."""

from __future__ import annotations

import threading

import torch
import torch.distributed.rpc as rpc
from torch import nn

from remote_module._proxy import batching
from tests._faults import gates

_lock = threading.Lock()
_log: dict[str, list] = {}


def _record(name: str, value) -> None:
    with _lock:
        _log.setdefault(name, []).append(value)


def log(name: str) -> list:
    with _lock:
        return list(_log.get(name, []))


def splits(key) -> bool:
    """Whether the batcher of the module held under ``key`` still joins calls."""
    return batching.batcher_of(key)._splits


def has_batcher(key) -> bool:
    return batching.batcher_of(key) is not None


class Gated(nn.Module):
    """``forward(x, gate=None, name="m", **extra)``: held on ``gate``, records the first
    column of ``x`` under ``name``, returns ``self.compute(x, **extra)``."""

    def forward(self, x, gate=None, name="m", **extra):
        if gate is not None:
            gates.hold(gate)
        _record(name, x.reshape(x.shape[0], -1)[:, 0].tolist() if x.dim() > 0 and x.numel() else [])
        return self.compute(x, **extra)

    def compute(self, x, **extra):
        return x * 2


class Norm(Gated):
    """BatchNorm1d(4), in training mode (nn.Module's default)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def compute(self, x, **extra):
        return self.bn(x)


class Stats(Gated):
    """``stats=True``: returns ``(x * 2, x.sum())`` (not splittable); else ``x * 2``."""

    def compute(self, x, stats=False, **extra):
        return (x * 2, x.sum()) if stats else x * 2


class Shapes(Gated):
    """Returns what ``kind`` asks for."""

    def compute(self, x, kind="tensor", **extra):
        if kind == "tuple_none":
            return (x + 1, None)
        if kind == "dict":
            return {"a": x + 1, "b": [x * 3]}
        if kind == "scalar":
            return x.sum()
        if kind == "none":
            return None
        if kind == "rpc":
            return rpc.rpc_sync("worker2", torch.add, (x, 1))
        return x * 2


class KwOnly(nn.Module):
    def forward(self, *, x, y):
        _record("kwonly", list(x.shape))
        return x + y


_saved_filters: list = []


def warnings_as_errors(on: bool) -> None:
    """Turn warnings into errors in this host process (as ``-W error`` would), or back."""
    import warnings

    if on:
        _saved_filters[:] = list(warnings.filters)
        warnings.simplefilter("error")
    else:
        warnings.filters[:] = _saved_filters
        warnings._filters_mutated()
