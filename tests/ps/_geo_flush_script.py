"""Run by tests/ps/test_dense_faults.py in a process of its own (one trainer, two servers): geo
training whose last steps come after the last ``geo_push_every`` boundary. ``flush()`` pushes
them: then the servers hold what one local process trained (a PSModel with a table, pulled
back; a table alone, read on its servers). Two more jobs end with local steps never pushed
(no flush): the process must warn of each as it ends, and of nothing else."""

from __future__ import annotations

import sys

import torch
from torch import nn

STEPS, EVERY, LR = 5, 3, 0.05


class Clicks(nn.Module):
    def __init__(self, bag: nn.Module) -> None:
        super().__init__()
        self.bag = bag
        self.dense = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.dense(self.bag(ids, offsets))


def batches() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 50, (12,), generator=gen), torch.tensor([0, 3, 7, 9]),
             torch.randn(4, 1, generator=gen)) for _ in range(STEPS)]


def body() -> dict | None:
    import torch.distributed.rpc as rpc

    from remote_module.ps import PSModel, ShardedEmbeddingBag
    from remote_module.ps.tables.server import _checkpoint_handlers
    from rpc_backend import current_worker

    me = current_worker()
    if me.role != "trainer":
        return None
    servers = me.workers("ps")
    opt = (torch.optim.SGD, {"lr": LR})
    torch.manual_seed(0)
    bag = ShardedEmbeddingBag(50, 4, servers, name="geo-flush-bag", mode="sum", ps_mode="geo", geo_push_every=EVERY,
                              optimizer=opt, min_block_size=8)
    model = PSModel(Clicks(bag), servers, name="geo-flush", num_trainers=1, ps_mode="geo", geo_push_every=EVERY,
                    optimizer=opt, min_block_size=2)
    local = Clicks(nn.EmbeddingBag(50, 4, mode="sum", sparse=True))
    local.load_state_dict(model.module.state_dict())
    local_opt = torch.optim.SGD(local.parameters(), lr=LR)
    alone = ShardedEmbeddingBag(50, 4, servers, name="geo-flush-alone", mode="sum", ps_mode="geo",
                                geo_push_every=EVERY, optimizer=opt, min_block_size=8)
    local_alone = nn.EmbeddingBag(50, 4, mode="sum", sparse=True)
    local_alone.load_state_dict(alone.state_dict())
    alone_opt = torch.optim.SGD(local_alone.parameters(), lr=LR)
    for ids, offsets, target in batches():
        ((model(ids, offsets) - target) ** 2).mean().backward()
        model.step()
        local_opt.zero_grad()
        ((local(ids, offsets) - target) ** 2).mean().backward()
        local_opt.step()
        (alone(ids, offsets) ** 2).mean().backward()
        alone.step()
        alone_opt.zero_grad()
        (local_alone(ids, offsets) ** 2).mean().backward()
        alone_opt.step()

    def on_servers() -> dict[str, float]:
        """How far the servers' values are from the local process's (nothing pushed or
        written): the dense part's blocks, and the lone table's rows."""
        values, ref = model._server_values(), dict(local.named_parameters())
        dense = max(float((values[b.name].reshape(-1) - model._block_values(b, ref[b.pname].detach()).reshape(-1))
                          .abs().max()) for b in model._slots)
        got = [rpc.rpc_sync(s, _checkpoint_handlers._block_rows, args=("geo-flush-alone", first))
               for first, _, s in alone._ranges]
        rows = torch.cat([r for _, r in got])[torch.argsort(torch.cat([i for i, _ in got]))]
        return {"dense": dense, "alone": float((rows - local_alone.weight.detach()).abs().max())}

    out = {"before": on_servers()}
    model.flush()
    alone.flush()
    out["after"] = on_servers()
    model.pull()  # the servers' values, the table's too (the local copy replaced)
    out["model"] = max(float((v - local.state_dict()[k]).abs().max()) for k, v in model.module.state_dict().items())
    # never flushed: warned of as the process ends
    left = PSModel(nn.Linear(4, 1), servers, name="geo-left", num_trainers=1, ps_mode="geo", geo_push_every=EVERY,
                   optimizer=opt)
    for _ in range(2):
        left(torch.ones(2, 4)).sum().backward()
        left.step()
    out["unpushed_saved"] = left.optimizer_state_dict()["geo"]["unpushed"]  # (a checkpoint keeps the count)
    left_bag = ShardedEmbeddingBag(50, 4, servers, name="geo-left-bag", ps_mode="geo", geo_push_every=EVERY,
                                   optimizer=opt)
    left_bag(torch.tensor([[1, 2]])).sum().backward()
    left_bag.step()
    return out


if __name__ == "__main__":
    from rpc_backend import run_local
    from tests._deadlines import SETUP_S

    got = run_local(body, 3, roles={"ps": 2, "trainer": 1}, rpc_timeout=SETUP_S)[2]
    print("geo-flush", got)
    sys.stdout.flush()
