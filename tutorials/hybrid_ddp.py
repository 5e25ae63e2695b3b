"""A hybrid model trained by two DDP trainers around one shared remote embedding.

    python tutorials/hybrid_ddp.py [--steps 200]

Three local processes: ``ps`` hosts an ``EmbeddingBag`` (a RemoteModule), ``trainer0`` and
``trainer1`` each hold a local MLP wrapped in ``DistributedDataParallel`` (gloo, trainers
only). Every step runs under distributed autograd; one ``DistributedOptimizer`` per trainer
updates its local parameters and the shared remote table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.optim import DistributedOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from remote_module import RemoteModule
from rpc_backend import fresh_file_rendezvous, run_local

NUM_EMBEDDINGS, DIM, CLASSES, BAG = 50, 16, 3, 2
_shared: dict = {}


class HybridModel(nn.Module):
    def __init__(self, embedding: RemoteModule) -> None:
        super().__init__()
        self.embedding = embedding  # remote, shared by both trainers
        self.mlp = DDP(nn.Sequential(nn.Linear(DIM, 16), nn.ReLU(), nn.Linear(16, CLASSES)))

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embedding(ids, offsets))


def shared_embedding() -> RemoteModule:
    """Runs on trainer0 when trainer1 asks: the proxy travels over RPC."""
    return _shared["embedding"]


def batch(gen: torch.Generator, teacher: torch.Tensor, size: int = 32) -> tuple:
    ids = torch.randint(0, NUM_EMBEDDINGS, (size * BAG,), generator=gen)
    labels = teacher[ids].view(size, BAG, CLASSES).sum(1).argmax(1)
    return ids, torch.arange(0, size * BAG, BAG), labels


def say(text: str) -> None:
    """A progress line, in one write: the three processes share the terminal."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def trainer(rank: int, pg_init_method: str, steps: int) -> list[float]:
    say(f"trainer{rank}: joining the trainers' DDP group")
    dist.init_process_group("gloo", init_method=pg_init_method, rank=rank, world_size=2)
    torch.manual_seed(0)  # the same MLP start on both trainers (DDP also broadcasts it)
    if rank == 0:
        _shared["embedding"] = RemoteModule("ps/cpu", nn.EmbeddingBag, (NUM_EMBEDDINGS, DIM), {"mode": "sum"})
    dist.barrier()
    embedding = _shared["embedding"] if rank == 0 else rpc.rpc_sync("trainer0", shared_embedding)
    say(f"trainer{rank}: building the model and its DistributedOptimizer (shared embedding on ps)")
    model = HybridModel(embedding)
    params = [rpc.RRef(p) for p in model.parameters()] + embedding.remote_parameters()
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.5)
    teacher = torch.randn(NUM_EMBEDDINGS, CLASSES, generator=torch.Generator().manual_seed(42))
    gen = torch.Generator().manual_seed(rank)
    losses = []
    say(f"trainer{rank}: training {steps} steps")
    last_line = time.monotonic()
    for step in range(1, steps + 1):
        ids, offsets, labels = batch(gen, teacher)
        with dist_autograd.context() as ctx:
            loss = nn.functional.cross_entropy(model(ids, offsets), labels)
            dist_autograd.backward(ctx, [loss])
            opt.step(ctx)
        losses.append(loss.item())
        if step == 1 or time.monotonic() - last_line >= 2.0:  # a line every 2 s: a run takes a while
            last_line = time.monotonic()
            say(f"trainer{rank}: step {step}/{steps}, loss {losses[-1]:.3f}")
    dist.barrier()  # trainer0 keeps the shared proxy alive until trainer1 is done
    dist.destroy_process_group()
    return losses


def main(pg_init_method: str, steps: int) -> list[float] | None:
    name = rpc.get_worker_info().name
    if name == "ps":
        return None  # only hosts the embedding
    return trainer(int(name[-1]), pg_init_method, steps)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    steps = parser.parse_args().steps
    pg_init_method, path = fresh_file_rendezvous()
    print(f"Starting 3 local processes (trainer0, trainer1, ps) for {steps} steps...", flush=True)
    try:
        results = run_local(main, 3, names=["trainer0", "trainer1", "ps"], args=(pg_init_method, steps), timeout=600,
                            progress=lambda message: say(f"  {message}"))
    finally:
        if os.path.exists(path):
            os.unlink(path)
    for rank in (0, 1):
        losses = results[rank]
        k = max(1, len(losses) // 10)
        first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
        print(f"trainer{rank}: loss {first:.3f} -> {last:.3f}")
    sys.exit(0)
