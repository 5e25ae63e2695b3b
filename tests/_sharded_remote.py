"""Functions and modules the sharded tests run on the workers (importable there)."""

from __future__ import annotations

import torch
from torch import nn

from remote_module.sharded import mesh_rank, mesh_size


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
    from remote_module.sharded._store import held_count as count

    return count()


class ColumnParallel(nn.Module):
    """A column-parallel shard: ``relu(x @ W_r.T + b_r)`` with this rank's output columns."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))
