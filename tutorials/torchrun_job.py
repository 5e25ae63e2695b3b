"""A torchrun job: one parameter server and N-1 trainers (DDP among trainers only).

See tutorials/torchrun.md for the single-machine and two-machine commands. Every rank runs
this same script; roles come from the world size: ps0, trainer0 .. trainer{N-2}.
"""

import sys

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.optim import DistributedOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from remote_module import RemoteModule
from rpc_backend import init_from_env, init_role_process_group, read_env

STEPS = 60


def say(line: str) -> None:
    """One write per line: torchrun merges the ranks' output, and print() writes twice."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def train(me) -> None:
    init_role_process_group(me)  # gloo among the trainers, on torchrun's store
    torch.manual_seed(0)
    # each trainer's remote layer lives on the parameter server
    remote = RemoteModule("ps0/cpu", nn.Linear, (8, 8))
    head = DDP(nn.Linear(8, 1))
    params = [rpc.RRef(p) for p in head.parameters()] + remote.remote_parameters()
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.05)
    gen = torch.Generator().manual_seed(me.role_rank)
    target_w = torch.randn(8, 1, generator=torch.Generator().manual_seed(7))
    losses = []
    for _ in range(STEPS):
        x = torch.randn(32, 8, generator=gen)
        with dist_autograd.context() as ctx:
            loss = ((head(remote(x)) - x @ target_w) ** 2).mean()
            dist_autograd.backward(ctx, [loss])
            opt.step(ctx)
        losses.append(loss.item())
    dist.barrier()
    dist.destroy_process_group()
    say(f"{me.name}: loss {losses[0]:.3f} -> {losses[-1]:.4f}")


def main() -> None:
    world_size = read_env()["world_size"]
    with init_from_env(roles={"ps": 1, "trainer": world_size - 1}) as me:
        if me.role == "trainer":
            train(me)
        else:
            say(f"{me.name}: serving {world_size - 1} trainers")


if __name__ == "__main__":
    main()
