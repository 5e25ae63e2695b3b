"""What the hostile sharded tests run on the workers (importable there)."""

from __future__ import annotations

import torch
from torch import nn

from remote_module.sharded import _host


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

