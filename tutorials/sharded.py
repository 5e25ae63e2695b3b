"""Shard-local modules: one module per worker, each on its own shard, outputs combined as declared.

    python tutorials/sharded.py      (or: python -m tutorials.sharded)

Three local processes: ``worker0`` drives; ``worker1`` and ``worker2`` form the mesh and run
no code of their own (they only join RPC and serve until the driver is done). Two parts:

1. The seed example. Each mesh worker makes its own input shard, ``arange(0, 10) + rank``
   (placement ``Shard(0)``: the global tensor is the two shards concatenated); a module that
   multiplies by a mask (rank 0 keeps positions 1..2, rank 1 positions 4..6) and returns
   ``sum(x) / mask.sum()`` runs on every worker on its own shard; the output is declared
   ``Partial("sum")``, so its global value is the sum of the local ones: 1.5 + 6.0 = 7.5.
2. One training step of a Megatron-style MLP over the same two workers: a column-parallel
   ``Linear`` + ReLU (each worker holds half the hidden units; output ``Shard(-1)``), then a
   row-parallel ``Linear`` without bias (output ``Partial("sum")``; the bias is added once,
   after the reduction). The hidden activation never leaves the workers. The step runs under
   distributed autograd with one ``DistributedOptimizer`` and is checked against the same
   step on a local model.

Classes and functions the workers run are module level here and referred to through the
module's importable name (``tutorials.sharded``), so RPC can send them by reference.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # `python tutorials/sharded.py`: the workers import tutorials.sharded
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.tensor import Partial, Replicate, Shard

from remote_module.sharded import LocalModule, from_local, mesh_rank
from rpc_backend import run_local

MESH = ["worker1", "worker2"]


# ---- what the workers run (module level: RPC sends it by reference) -------------------------


def arange_plus_rank() -> torch.Tensor:
    """Runs on each mesh worker: its input shard."""
    return torch.arange(0, 10, dtype=torch.float32) + mesh_rank()


class MaskedMean(nn.Module):
    """Mean of this worker's masked positions: rank 0 keeps 1..2, rank 1 keeps 4..6."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros_like(x)
        if mesh_rank() == 0:
            mask[1:3] = 1
        else:
            mask[4:7] = 1
        return (x * mask).sum() / mask.sum()


class ColumnParallel(nn.Module):
    """``relu(x @ W[s].T + b[s])``: this worker's hidden units ``s`` (weights given by the caller)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__()
        self.linear = nn.Linear(weight.shape[1], weight.shape[0])
        with torch.no_grad():
            self.linear.weight.copy_(weight)
            self.linear.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class RowParallel(nn.Module):
    """``h_s @ W[:, s].T``: this worker's share of the output, summed over the workers."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        with torch.no_grad():
            self.linear.weight.copy_(weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.linear(h)


# ---- the driver (worker0) ---------------------------------------------------------------------


def seed_example() -> tuple[list[float], float]:
    import tutorials.sharded as here  # the importable name, which the workers can import too

    x = from_local(here.arange_plus_rank, MESH, Shard(0))  # made on the workers, stays there
    masked = LocalModule(MESH, here.MaskedMean, out_placements=Partial("sum"))
    out = masked(x)  # both workers run MaskedMean on their own shard, concurrently
    local = [t.item() for t in out.local_shards()]
    total = out.full_tensor().item()  # Partial(sum): the local results, summed
    print(f"x: {x}")
    print(f"local results: {local}")
    print(f"full_tensor(): {total}")
    return local, total


def megatron_step() -> float:
    import tutorials.sharded as here

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))  # the local reference
    up, down = model[0], model[2]
    halves = torch.arange(16).tensor_split(len(MESH))  # hidden units of each worker
    with torch.no_grad():
        col = LocalModule(
            MESH, here.ColumnParallel, lambda r: ((up.weight[halves[r]].clone(), up.bias[halves[r]].clone()), None),
            in_placements=[Replicate()], out_placements=Shard(-1),
        )
        row = LocalModule(
            MESH, here.RowParallel, lambda r: ((down.weight[:, halves[r]].clone(),), None),
            in_placements=[Shard(-1)], out_placements=Partial("sum"),
        )
    bias = nn.Parameter(down.bias.detach().clone())  # added once, after the partial sums are reduced
    print(col)
    print(row)
    opt = DistributedOptimizer(
        torch.optim.SGD, col.remote_parameters() + row.remote_parameters() + [rpc.RRef(bias)], lr=0.1
    )
    x, target = torch.randn(32, 8), torch.randn(32, 8)
    with dist_autograd.context() as ctx:
        hidden = col(x)  # Shard(-1): each worker holds its 8 hidden units, nothing comes back
        y = row(hidden).full_tensor() + bias  # only the (32, 8) output reaches the caller
        loss = nn.functional.mse_loss(y, target)
        dist_autograd.backward(ctx, [loss])
        opt.step(ctx)  # SGD on each worker's shard parameters, and on the caller's bias

    reference = torch.optim.SGD(model.parameters(), lr=0.1)  # the same step, locally
    nn.functional.mse_loss(model(x), target).backward()
    reference.step()
    with torch.no_grad():
        diff = max(
            (col(x).full_tensor() - torch.relu(up(x))).abs().max().item(),
            (row(col(x)).full_tensor() + bias - model(x)).abs().max().item(),
        )
    print(f"Megatron MLP step: loss {loss.item():.4f}; max difference from a local model after the step: {diff:.2e}")
    return diff


def main() -> tuple | None:
    if rpc.get_worker_info().name != "worker0":
        return None  # worker1 and worker2 only host the shards
    local, total = seed_example()
    diff = megatron_step()
    return local, total, diff


if __name__ == "__main__":
    print("Starting 3 local processes (worker0 runs the examples, worker1 and worker2 host the shards)...", flush=True)
    local, total, diff = run_local(main, 3, timeout=300, progress=lambda message: print(f"  {message}", flush=True))[0]
    if local != [1.5, 6.0] or total != 7.5 or diff > 1e-5:
        raise SystemExit(f"unexpected results: local {local}, full {total}, MLP difference {diff}")
