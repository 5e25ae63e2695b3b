"""An MNIST-sized MLP trained on two parameter servers by two trainers.

    python tutorials/parameter_server.py [--mode sync|async|half_async|geo] [--steps 40]
                                         [--checkpoint DIR --every N]
    torchrun --standalone --nproc-per-node=4 tutorials/parameter_server.py --mode sync

Four processes: ``ps0`` and ``ps1`` are parameter servers and run no code of their own (they
join RPC and wait); ``trainer0`` and ``trainer1`` each wrap the same local
``Linear(784, 128) + ReLU + Linear(128, 10)`` in a :class:`remote_module.ps.PSModel`. Its
parameters are sliced into blocks spread over the two servers (``fc1.weight``, 100,352
elements, becomes two 50,176-element blocks, one per server; the smaller tensors stay whole),
and each server runs SGD on the blocks it holds. Data is synthetic: a fixed random 784-pixel
prototype per class plus Gaussian noise, a different stream per trainer.

Run as a plain script, it starts the four processes itself with ``rpc_backend.run_local``;
under torchrun (every rank runs this same file) it joins the job with
``rpc_backend.init_from_env``. Either way the roles are ``{"ps": 2, "trainer": N - 2}``
and the code each role runs is the same. Each trainer prints its loss, the mean of its first
and of its last few steps. With ``--checkpoint DIR`` the job is saved every ``--every`` steps
(:class:`remote_module.ps.Checkpointer`), and a run started again with the same DIR resumes from
the newest checkpoint there.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

from remote_module.ps import Checkpointer, PSModel
from rpc_backend import current_worker, init_from_env, read_env, run_local

IN, HIDDEN, CLASSES, BATCH = 784, 128, 10, 64


def say(line: str) -> None:
    """One write per line: under torchrun the ranks' output is interleaved."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def mlp() -> nn.Module:
    torch.manual_seed(0)  # the same start on every trainer (the first to attach initialises the servers)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


def batches(gen: torch.Generator, steps: int):
    """Synthetic MNIST-shaped data drawn from ``gen``: a fixed 784-pixel prototype per class,
    plus noise."""
    prototypes = torch.rand(CLASSES, IN, generator=torch.Generator().manual_seed(42))
    for _ in range(steps):
        y = torch.randint(0, CLASSES, (BATCH,), generator=gen)
        yield prototypes[y] + torch.randn(BATCH, IN, generator=gen), y


def train(args: argparse.Namespace) -> list[float]:
    """What a trainer runs (``current_worker()`` says which one and who the servers are)."""
    me = current_worker()
    model = PSModel(
        mlp(), me.workers("ps"), name="mnist-mlp", num_trainers=me.role_size, ps_mode=args.mode,
        optimizer=(torch.optim.SGD, {"lr": args.lr}), geo_push_every=args.geo_push_every,
    )
    # torch's LR schedulers drive the servers' optimizer through model.ps_optimizer
    scheduler = torch.optim.lr_scheduler.StepLR(model.ps_optimizer, step_size=args.lr_step_size, gamma=0.5)
    gen = torch.Generator().manual_seed(1000 + me.role_rank)  # this trainer's data stream
    ckpt, start = None, 0
    if args.checkpoint:  # the servers' blocks once, each trainer's scheduler and data stream
        ckpt = Checkpointer(args.checkpoint, every_steps=args.every, ps={"model": model},
                            local={"scheduler": scheduler, "data": gen})
        start = ckpt.resume()  # 0, or the steps the newest checkpoint holds
        if start:
            say(f"{me.name}: resumed from step {start}")
    losses = []
    for x, y in batches(gen, args.steps - start):
        loss = nn.functional.cross_entropy(model(x), y)  # forward gets the parameters first (not in geo)
        loss.backward()
        model.step()  # pushes the gradients (geo: steps the local copy, pushes deltas every k steps)
        scheduler.step()  # the next push carries the new lr (model.step() called ps_optimizer.step())
        if ckpt is not None:
            ckpt.step()  # saves every --every steps
        losses.append(loss.item())
    if ckpt is not None:
        ckpt.close()  # the last checkpoint complete
    k = max(1, len(losses) // 10)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    say(f"{me.name}: mode {args.mode}, {len(losses)} steps, loss {first:.3f} -> {last:.3f}")
    return losses


def main(args: argparse.Namespace) -> list[float] | None:
    """Every rank runs this; servers return at once and serve until the trainers are done."""
    if current_worker().role == "ps":
        return None
    return train(args)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["sync", "async", "half_async", "geo"], default="sync")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--lr-step-size", type=int, default=20, help="halve the lr every k steps (StepLR)")
    parser.add_argument("--geo-push-every", type=int, default=5, help="geo: push deltas every k steps")
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--trainers", type=int, default=2, help="without torchrun (with it: world size - servers)")
    parser.add_argument("--checkpoint", default="", help="save the job here every --every steps, and resume from it")
    parser.add_argument("--every", type=int, default=10, help="with --checkpoint: the steps between checkpoints")
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = parse()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
        world_size = read_env()["world_size"]
        with init_from_env(roles={"ps": args.servers, "trainer": world_size - args.servers}) as me:
            if me.role == "ps":
                say(f"{me.name}: serving {world_size - args.servers} trainers")
            main(args)
    else:  # one machine: start the ranks here
        say(f"Starting {args.servers + args.trainers} local processes (servers: {args.servers}, trainers: "
            f"{args.trainers})...")
        run_local(main, args.servers + args.trainers, roles={"ps": args.servers, "trainer": args.trainers},
                  args=(args,), timeout=600, progress=lambda message: say(f"  {message}"))
