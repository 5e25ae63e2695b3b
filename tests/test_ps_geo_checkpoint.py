"""PSModel.state_dict() in geo mode returns the servers' values without touching the trainer's
local copy: its progress since the last push is still pushed in full afterwards (state_dict()
used to overwrite the local copy with the servers' values, losing that progress, and with
other trainers re-pushing their merged deltas)."""

import pytest
import torch
from torch import nn

from rpc_backend import current_worker, run_local


def _geo_checkpoint_between_pushes() -> dict | None:
    from remote_module.ps import PSModel

    me = current_worker()
    if me.role == "ps":
        return None
    model = PSModel(nn.Linear(1, 1, bias=False), ["ps0"], name="geo-ckpt", num_trainers=1, mode="geo",
                    optimizer=(torch.optim.SGD, {"lr": 1.0}), geo_push_every=2, timeout=30)
    with torch.no_grad():
        model.module.weight.fill_(0.0)
    model.load_state_dict({"weight": torch.zeros(1, 1)})  # servers and local copy at 0

    def step() -> None:  # gradient of weight is exactly 1: SGD lr 1 moves it by -1
        model.module(torch.ones(1, 1)).sum().backward()
        model.step()

    step()  # local -1, nothing pushed yet
    mid = model.state_dict()["weight"].item()
    local_mid = model.module.weight.item()
    step()  # second step: pushes delta -2
    return {"mid": mid, "local_mid": local_mid, "end": model.state_dict()["weight"].item(),
            "local_end": model.module.weight.item()}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_geo_checkpoint_keeps_local_progress():
    got = run_local(_geo_checkpoint_between_pushes, 2, roles={"ps": 1, "trainer": 1}, timeout=100)[1]
    assert got["mid"] == 0.0  # the servers' value: nothing pushed yet
    assert got["local_mid"] == -1.0  # the local copy kept its step
    assert got["end"] == -2.0, got  # both steps reached the server (was -1: the first was lost)
    assert got["local_end"] == -2.0
