"""``make demo-hybrid``: train a small hybrid model on a local two-process RPC world (the
first demo; ``make demo`` runs the DLRM click model, :mod:`remote_module.demos.dlrm`).

The trainer holds a local ``Linear`` head; the host worker holds an ``EmbeddingBag`` behind
a :class:`~remote_module.RemoteModule`. Both train together under distributed autograd and
one ``DistributedOptimizer``, on synthetic data whose labels come from a hidden "teacher"
table, so the loss has somewhere to go.

    python -m remote_module.demos.hybrid [--steps 300] [--batch 64]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.optim import DistributedOptimizer

from remote_module import RemoteModule
from remote_module.demos._script import run_script
from remote_module.demos.progress import bar_hidden, progress_bar
from rpc_backend import run_local

NUM_EMBEDDINGS = 1000
DIM = 16
CLASSES = 4
BAG = 8
PLAIN_LINES = 10  # progress lines per run when no bar is shown (stderr no terminal)


def synthetic_batch(gen: torch.Generator, teacher: torch.Tensor, batch: int) -> tuple:
    """Bags of ids, their offsets, and labels from the teacher's summed embeddings."""
    ids = torch.randint(0, NUM_EMBEDDINGS, (batch * BAG,), generator=gen)
    offsets = torch.arange(0, batch * BAG, BAG)
    labels = teacher[ids].view(batch, BAG, CLASSES).sum(1).argmax(1)
    return ids, offsets, labels


def train(steps: int, batch: int, progress: bool = True) -> dict:
    """The trainer's job: returns loss before/after and steps per second."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    teacher = torch.randn(NUM_EMBEDDINGS, CLASSES, generator=gen)
    embedding = RemoteModule("host/cpu", nn.EmbeddingBag, (NUM_EMBEDDINGS, DIM), {"mode": "sum"})
    head = nn.Linear(DIM, CLASSES)
    params = [rpc.RRef(p) for p in head.parameters()] + embedding.remote_parameters()
    opt = DistributedOptimizer(torch.optim.Adam, params, lr=0.01)
    loss_fn = nn.CrossEntropyLoss()

    eval_batch = synthetic_batch(torch.Generator().manual_seed(2), teacher, 512)

    def eval_loss() -> float:
        ids, offsets, labels = eval_batch
        with torch.no_grad():
            return loss_fn(head(embedding(ids, offsets)), labels).item()

    before = eval_loss()
    bar = progress_bar(steps, progress, desc="hybrid training", unit="step")
    # off a terminal (a pipe, a file) tqdm's frames would pile up on one line: plain lines instead
    plain_every = max(1, steps // PLAIN_LINES) if progress and bar_hidden(bar) else None
    start = time.perf_counter()
    for step in range(1, steps + 1):
        ids, offsets, labels = synthetic_batch(gen, teacher, batch)
        with dist_autograd.context() as ctx:
            loss = loss_fn(head(embedding(ids, offsets)), labels)
            dist_autograd.backward(ctx, [loss])
            opt.step(ctx)
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if plain_every is not None and (step % plain_every == 0 or step == steps):
            print(f"hybrid training: step {step}/{steps}, loss {loss.item():.3f}", flush=True)
    elapsed = time.perf_counter() - start
    bar.close()
    after = eval_loss()
    return {"loss_before": before, "loss_after": after, "steps": steps, "steps_per_s": steps / elapsed}


def _rank_main(steps: int, batch: int, progress: bool) -> dict | None:
    torch.manual_seed(0)  # the host initializes the embedding table
    if rpc.get_worker_info().name == "trainer":
        return train(steps, batch, progress)
    return None  # the host only serves the remote EmbeddingBag


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m remote_module.demos.hybrid",
        description="Train a small hybrid model (a remote EmbeddingBag and a local Linear head) on a local "
        "two-process RPC world.",
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--no-progress", action="store_true")
    opts = parser.parse_args(argv)
    if opts.steps < 1 or opts.batch < 1:
        parser.error("--steps and --batch must be positive")
    print("Starting a local RPC world on loopback: 'trainer' and 'host' (2 processes)...", flush=True)
    summary = run_local(
        _rank_main, 2, names=["trainer", "host"], args=(opts.steps, opts.batch, not opts.no_progress), timeout=600
    )[0]
    print(
        f"\nRemote EmbeddingBag({NUM_EMBEDDINGS}, {DIM}) on 'host' + local Linear({DIM}, {CLASSES}) on 'trainer'\n"
        f"  steps:        {summary['steps']}\n"
        f"  loss before:  {summary['loss_before']:.4f}\n"
        f"  loss after:   {summary['loss_after']:.4f}\n"
        f"  throughput:   {summary['steps_per_s']:.1f} steps/s"
    )
    return summary


if __name__ == "__main__":
    run_script(main)
