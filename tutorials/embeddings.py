"""A sharded embedding table trained on a parameter server, with a local MLP on top.

    python tutorials/embeddings.py [--steps 100]      (or: python -m tutorials.embeddings)

Two local processes: ``ps0`` holds the rows of a ``ShardedEmbeddingBag`` (1,000 rows x 8) and
runs no code of its own (it joins RPC and waits); ``trainer0`` looks bags of ids up in it, puts
a local ``Linear`` on top and learns a hidden score per row. Each step pulls only the rows the
batch touches (the server pools each bag and sends one vector per bag) and pushes only those
rows' gradients, which the server applies with a row-wise Adagrad. At the end the table's
checkpoint loads into a plain ``nn.EmbeddingBag`` that gives the same outputs, and the server
saves its own rows (``save_shards``) for a fresh table to load (``load_shards``) and for
``torch.distributed.checkpoint`` to read. Prints the loss, the bytes pushed per step, and the
checkpoint checks.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from remote_module.ps import ShardedEmbeddingBag, load_shards, prefetching, save_shards
from rpc_backend import current_worker, run_local

ROWS, DIM, BAG, BATCH = 1_000, 8, 4, 64


class Scorer(nn.Module):
    """Pooled rows of each bag -> one score; the table is remote, the head is local."""

    def __init__(self, servers: list[str]) -> None:
        super().__init__()
        self.items = ShardedEmbeddingBag(
            ROWS, DIM, servers, name="tutorial.items", mode="sum",
            optimizer=(torch.optim.Adagrad, {"lr": 0.3}),  # row-wise, on the servers
        )
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.items(ids)).squeeze(1)  # ids: (bags, BAG), one bag per row


def batches(steps: int):
    """Bags of 4 ids; the target is the sum of a hidden score per id."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(ROWS, generator=gen)
    for _ in range(steps):
        ids = torch.randint(0, ROWS, (BATCH, BAG), generator=gen)
        yield ids, hidden[ids].sum(1)


def train(steps: int) -> dict:
    me = current_worker()
    torch.manual_seed(0)
    model = Scorer(me.workers("ps"))
    print(model.items, flush=True)
    opt = torch.optim.SGD(model.head.parameters(), lr=0.05)  # the local part
    losses = []
    # each step also sends the next batch's lookup (one message to ps0 per step)
    for ids, target in prefetching(batches(steps), model.items, features=lambda batch: batch[0]):
        loss = nn.functional.mse_loss(model(ids), target)
        opt.zero_grad()
        model.items.zero_grad()
        loss.backward()
        opt.step()  # the head, locally
        model.items.step()  # pushes the touched rows' gradients to ps0 (and returns)
        losses.append(loss.item())
        if len(losses) % max(1, steps // 4) == 0:  # a line as it goes
            print(f"{me.name}: step {len(losses)}/{steps}, loss {losses[-1]:.3f}", flush=True)

    # the checkpoint has the local module's key: it loads into a plain nn.EmbeddingBag
    local = nn.EmbeddingBag(ROWS, DIM, mode="sum")
    local.load_state_dict(model.items.state_dict())
    ids = torch.randint(0, ROWS, (8, BAG))
    with torch.no_grad():
        diff = (local(ids) - model.items(ids)).abs().max().item()
    return {"losses": losses, "pushed_per_step": model.items.pushed_bytes / steps, "diff": diff,
            "shards": shard_checkpoint(model.items, me.workers("ps"), local.weight)}


def shard_checkpoint(items: ShardedEmbeddingBag, servers: list[str], weight: torch.Tensor) -> dict:
    """Servers save their own rows (the trainer writes a small manifest), a fresh table loads
    them, and torch.distributed.checkpoint reads the eager table's files as a checkpoint."""
    with tempfile.TemporaryDirectory() as path:
        manifest = save_shards(path, {"items": items})  # each server writes its own blocks
        again = ShardedEmbeddingBag(ROWS, DIM, servers, name="tutorial.items-again", mode="sum",
                                    optimizer=(torch.optim.Adagrad, {"lr": 0.3}))
        load_shards(path, {"items": again})  # each server reads its own blocks (checksums checked)
        state = {"items.weight": torch.empty(ROWS, DIM)}  # a local model's state_dict keys
        with warnings.catch_warnings():  # (dcp says it assumes one process: it is one)
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=path, no_dist=True)
    return {"files": len(manifest["files"]), "loaded": torch.equal(again.state_dict()["weight"], weight),
            "dcp": torch.equal(state["items.weight"], weight)}


def main(steps: int) -> dict | None:
    if current_worker().role == "ps":
        return None  # the server only holds rows and applies updates
    return train(steps)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    steps = parser.parse_args().steps
    print(f"Starting 2 local processes (ps0, trainer0) for {steps} steps...", flush=True)
    result = run_local(main, 2, roles={"ps": 1, "trainer": 1}, args=(steps,), timeout=300,
                       progress=lambda message: print(f"  {message}", flush=True))[1]
    losses = result["losses"]
    k = max(1, len(losses) // 10)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    print(f"trainer0: loss {first:.3f} -> {last:.3f}")
    print(f"pushed per step: {result['pushed_per_step'] / 1024:.1f} KiB (table: {ROWS * DIM * 4 / 1024:.0f} KiB)")
    print(f"checkpoint in nn.EmbeddingBag: max difference {result['diff']:.1e}")
    shards = result["shards"]
    print(f"shard checkpoint ({shards['files']} files): loaded equal {shards['loaded']}, dcp.load equal "
          f"{shards['dcp']}")
    if not last < first or result["diff"] > 1e-5 or not (shards["loaded"] and shards["dcp"]):
        sys.exit("unexpected result: the loss did not go down or a checkpoint differs")
