"""What tests/ps/test_collection_schedule_in_psmodel.py runs on a trainer."""

from __future__ import annotations

import warnings

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc
        self.lin = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.ebc({"a": ids, "b": ids})
        return self.lin(out["a"] + out["b"]).squeeze(1)


def scheduled_in_psmodel(name: str, steps: int) -> dict:
    """A StepLR on the ps_optimizer of a collection inside a PSModel, stepped after each
    ``model.step()``: torch's warnings about the order of the calls, and the tables' lrs."""
    from remote_module.ps import PSModel, ShardedEmbeddingBag, ShardedEmbeddingBagCollection

    servers = ["ps0", "ps1"]
    ebc = ShardedEmbeddingBagCollection({k: ShardedEmbeddingBag(10, 4, servers, name=f"{name}.{k}", mode="sum",
                                                                     optimizer=(torch.optim.SGD, {"lr": 0.1}))
                                         for k in "ab"})
    torch.manual_seed(0)
    model = PSModel(Net(ebc), servers, name=f"{name}.dense", num_trainers=1, ps_mode="async")
    sched = torch.optim.lr_scheduler.StepLR(ebc.ps_optimizer, step_size=1, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            loss = model(torch.randint(0, 10, (4, 2), generator=g)).pow(2).mean()
            model.zero_grad()
            loss.backward()
            model.step()
            sched.step()
        model.flush()
    return {"warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
            "lrs": [t.ps_optimizer.param_groups[0]["lr"] for t in ebc.tables().values()]}
