"""What tests/ps/test_resume_every_trainer.py runs on its two sync trainers: a PSModel holding a
table, each with a scheduler; resumed from a checkpoint the way parameter-servers.md says."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

ROWS, DIM = 10, 3

#: this process's (model, schedulers) by job name, kept between calls
_jobs: dict[str, Any] = {}


class Net(nn.Module):
    def __init__(self, bag: nn.Module) -> None:
        super().__init__()
        self.bag = bag
        self.lin = nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.lin(self.bag(ids, offsets)).squeeze(1)


def build(name: str, trainer: int) -> str:
    """This trainer's model of job ``name`` and its two schedulers (dense, rows), kept; the
    table's rows set by trainer0 (a table's first rows depend on its name)."""
    from remote_module.ps import PSModel, ShardedEmbeddingBag

    torch.manual_seed(0)
    bag = ShardedEmbeddingBag(ROWS, DIM, ["ps0", "ps1"], name=f"{name}.bag", mode="sum", ps_mode="sync",
                              num_trainers=2, optimizer=(torch.optim.Adagrad, {"lr": 0.4}), timeout=30)
    model = PSModel(Net(bag), ["ps0", "ps1"], name=name, num_trainers=2, ps_mode="sync",
                    optimizer=(torch.optim.SGD, {"lr": 0.2, "momentum": 0.9}), min_block_size=2, timeout=30)
    scheds = [torch.optim.lr_scheduler.StepLR(model.ps_optimizer, step_size=1, gamma=0.5),
              torch.optim.lr_scheduler.StepLR(bag.ps_optimizer, step_size=1, gamma=0.7)]
    if trainer == 0:
        bag.load_state_dict({"weight": torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(3))})
    _jobs[name] = (model, scheds)
    return name


def train(name: str, trainer: int, first: int, steps: int) -> dict:
    """Steps ``first`` .. ``first + steps - 1`` of this trainer's batches; the state after (and
    the checkpoint a script saves, which its resume loads)."""
    model, scheds = _jobs[name]
    for k in range(first, first + steps):
        g = torch.Generator().manual_seed(100 * trainer + k)
        ids, target = torch.randint(0, ROWS, (6,), generator=g), torch.randn(3, generator=g)
        loss = (model(ids, torch.arange(3) * 2) - target).pow(2).mean()
        model.zero_grad()
        loss.backward()
        model.step()
        for s in scheds:
            s.step()
    return {"state": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": model.optimizer_state_dict(), "scheds": [s.state_dict() for s in scheds]}


def resume(name: str, trainer: int, ckpt: dict) -> None:
    """parameter-servers.md's resume of a multi-trainer job: the servers' state is loaded once
    (trainer0), every trainer restores its schedulers and its ps_optimizers' settings."""
    model, scheds = _jobs[name]
    if trainer == 0:
        model.load_state_dict(ckpt["state"])
        model.load_optimizer_state_dict(ckpt["optim"])  # (holds the ps_optimizers' settings too)
    else:
        model.ps_optimizer.load_state_dict(ckpt["optim"]["ps_optimizer"])
        for qual, table_state in ckpt["optim"]["tables"].items():
            model.module.get_submodule(qual).ps_optimizer.load_state_dict(table_state["ps_optimizer"])
    for s, state in zip(scheds, ckpt["scheds"]):
        s.load_state_dict(state)
