"""Rank function of tests/proxy/test_ddp.py: ``DistributedDataParallel`` around a whole hybrid
model whose embedding is a RemoteModule on ``ps0``; ``trainer0`` and ``trainer1`` train it.

The local reference (tests/proxy/test_ddp.py) uses :class:`HybridModel` and :func:`batch` from here.
"""

from __future__ import annotations

import io

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.optim import DistributedOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

NUM_EMBEDDINGS, DIM, CLASSES, BAG, BATCH = 20, 6, 3, 2, 8
LR = 0.3

_shared: dict = {}


class HybridModel(nn.Module):
    """An embedding (remote in the job, local in the reference) followed by a local MLP."""

    def __init__(self, embedding: nn.Module) -> None:
        super().__init__()
        self.embedding = embedding
        self.mlp = nn.Sequential(nn.Linear(DIM, 8), nn.ReLU(), nn.Linear(8, CLASSES))

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embedding(ids, offsets))


def batch(trainer: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (ids, offsets, labels) trainer ``trainer`` uses at ``step``."""
    gen = torch.Generator().manual_seed(1000 * trainer + step)
    ids = torch.randint(0, NUM_EMBEDDINGS, (BATCH * BAG,), generator=gen)
    labels = torch.randint(0, CLASSES, (BATCH,), generator=gen)
    return ids, torch.arange(0, BATCH * BAG, BAG), labels


def shared_embedding() -> nn.Module:
    """Runs on trainer0 when trainer1 asks: the proxy travels over RPC."""
    return _shared["embedding"]


def _dump(state: dict) -> bytes:
    buf = io.BytesIO()
    torch.save({k: v.detach().clone() for k, v in state.items()}, buf)
    return buf.getvalue()


def trainer_main(steps: int) -> dict | None:
    """On each trainer: DDP(model) for ``steps`` steps; returns its state before and after."""
    from remote_module import RemoteModule
    from rpc_backend import current_worker, init_role_process_group

    me = current_worker()
    if me.role != "trainer":
        return None  # ps0 only hosts the embedding
    from tests._deadlines import SETUP_S

    init_role_process_group(me, timeout=SETUP_S)  # its barriers wait for the other trainer
    if me.role_rank == 0:
        _shared["embedding"] = RemoteModule("ps0/cpu", nn.EmbeddingBag, (NUM_EMBEDDINGS, DIM), {"mode": "sum"})
    dist.barrier()
    embedding = _shared["embedding"] if me.role_rank == 0 else rpc.rpc_sync("trainer0", shared_embedding)
    torch.manual_seed(me.role_rank)  # different local starts: DDP broadcasts trainer0's
    model = DDP(HybridModel(embedding))
    initial = _dump(model.module.state_dict())
    params = [rpc.RRef(p) for p in model.parameters()] + embedding.remote_parameters()
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=LR)
    for step in range(steps):
        ids, offsets, labels = batch(me.role_rank, step)
        with dist_autograd.context() as ctx:
            loss = nn.functional.cross_entropy(model(ids, offsets), labels)
            dist_autograd.backward(ctx, [loss])
            # One trainer's step after the other's: DistributedOptimizer's TorchScript optimizers
            # (SGD's among them) take no lock on the host, so two steps on the shared table at
            # once can lose an update (torch's docs: no ordering across workers).
            if me.role_rank == 1:
                dist.barrier()
            opt.step(ctx)
            if me.role_rank == 0:
                dist.barrier()
        dist.barrier()  # both trainers' updates of the shared table land before the next forward
    final = _dump(model.module.state_dict())
    dist.barrier()  # trainer0 keeps the proxy alive until trainer1 has read the final state
    dist.destroy_process_group()
    return {"initial": initial, "final": final}
