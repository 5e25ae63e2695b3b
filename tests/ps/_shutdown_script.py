"""Run by tests/ps/test_prefetch.py in a process of its own (it ends its world): trainer0 trains
an async table three steps and leaves RPC (graceful shutdown) with the last step's pushes still
in flight; trainer1 polls the table until it holds all three steps (or a hang guard's deadline).
Prints one JSON line: whether trainer1 saw them, and how long it waited."""

from __future__ import annotations

import json
import sys
import time

from tests._deadlines import HANG_S, SETUP_S

STEPS = 3


def body() -> dict | None:
    import torch
    from torch import nn

    from remote_module.ps import ShardedEmbeddingBag
    from rpc_backend import current_worker

    me = current_worker()
    if me.role != "trainer":
        return None
    weights = torch.randn(50, 4, generator=torch.Generator().manual_seed(0))
    batches = [torch.tensor([[k, k + 20, 40 - k]]) for k in range(STEPS)]
    bag = ShardedEmbeddingBag(50, 4, me.workers("ps"), name="shutdown-in-flight", mode="sum", ps_mode="async",
                              num_trainers=2, optimizer=(torch.optim.SGD, {"lr": 0.5}), min_block_size=1)
    if me.name == "trainer0":
        bag.load_state_dict({"weight": weights})
        for ids in batches:
            bag(ids).pow(2).sum().backward()
            bag.step()  # returns with its pushes in flight: the last is still in flight at shutdown
        return {"left_in_flight": bag.__dict__.get("_flight") is not None}
    local = nn.EmbeddingBag(50, 4, mode="sum", sparse=True, _weight=weights.clone())
    opt = torch.optim.SGD(local.parameters(), lr=0.5)
    for ids in batches:
        opt.zero_grad()
        local(ids).pow(2).sum().backward()
        opt.step()
    start = time.monotonic()
    while time.monotonic() - start < HANG_S:
        rows = bag.state_dict()["weight"]
        if torch.allclose(rows, local.weight.detach(), atol=1e-6, rtol=1e-5):
            return {"seen": True, "waited_s": time.monotonic() - start}
        time.sleep(0.05)
    return {"seen": False, "waited_s": time.monotonic() - start,
            "max_diff": float((bag.state_dict()["weight"] - local.weight.detach()).abs().max())}


if __name__ == "__main__":
    from rpc_backend import run_local

    out = run_local(body, 3, roles={"ps": 1, "trainer": 2}, rpc_timeout=SETUP_S)
    print(json.dumps({"trainer0": out[1], "trainer1": out[2]}))
    sys.stdout.flush()
