"""What the hostile sharded tests run on the workers (importable there)."""

from __future__ import annotations

import torch
from torch import nn

from remote_module.sharded import _store


class Affine(nn.Module):
    """``x @ W.T`` with the same ``W`` on every worker (a replicated parameter)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


def stored_bytes() -> int:
    """Bytes of the storages behind the shards this process holds (a view counts its whole
    storage: that is what it keeps alive)."""
    with _store._store._lock:
        tensors = list(_store._store._tensors.values())
    return sum(t.untyped_storage().nbytes() for t in tensors)
