"""An MLP split into a 2-stage RPC pipeline on two workers, trained with distributed autograd.

    python tutorials/pipeline.py [--steps 8]

Three local processes: ``worker0`` drives (it holds no layers), ``worker1`` and ``worker2``
each host one stage and run no code of their own. ``split_sequential`` copies the layers of a
local ``nn.Sequential`` to the hosts; each forward is cut into 4 micro-batches that flow
worker1 -> worker2 -> worker0, so stage 0 already runs micro-batch i+1 while stage 1 runs i.
One ``DistributedOptimizer`` updates both stages' parameters where they live. Prints the loss
of every step and exits non-zero unless the loss went down.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.optim import DistributedOptimizer

from remote_module.pipeline import split_sequential
from rpc_backend import run_local


def train(steps: int) -> list[float]:
    """Runs on worker0: build the pipeline, train it on a fixed toy regression set."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    # Cut by parameter count: layers 0-1 go to worker1, layers 2-4 to worker2 (weights copied).
    pipe = split_sequential(model, ["worker1/cpu", "worker2/cpu"], chunks=4)
    print(pipe, flush=True)  # the stages, their workers and their layers
    opt = DistributedOptimizer(torch.optim.SGD, pipe.remote_parameters(), lr=0.2)
    x = torch.randn(128, 16)
    y = torch.sin(x[:, :4]) + 0.5 * x[:, 4:8]  # a target the MLP can fit
    losses = []
    for step in range(steps):
        with dist_autograd.context() as ctx:
            loss = nn.functional.mse_loss(pipe(x), y)  # 4 micro-batches through both stages
            dist_autograd.backward(ctx, [loss])  # back along the chain: worker0 -> worker2 -> worker1
            opt.step(ctx)  # SGD runs on each stage's host, on the gradients of this context
        losses.append(loss.item())
        print(f"step {step}: loss {loss.item():.4f}", flush=True)
    return losses


def main(steps: int) -> list[float] | None:
    if rpc.get_worker_info().name != "worker0":
        return None  # worker1 and worker2 only host the stages
    return train(steps)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    steps = parser.parse_args().steps
    print(f"Starting 3 local processes (worker0 trains, worker1 and worker2 host the stages) for {steps} steps...",
          flush=True)
    losses = run_local(main, 3, args=(steps,), timeout=300,
                       progress=lambda message: print(f"  {message}", flush=True))[0]
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    if not losses[-1] < losses[0]:
        sys.exit(f"the loss did not go down: {losses[0]:.4f} -> {losses[-1]:.4f}")
