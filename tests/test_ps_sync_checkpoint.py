"""PSModel.state_dict() in sync mode holds the trainer's own last step, however late the
other trainers push it (a checkpoint taken right after the training loop used to miss it)."""

import time

import pytest
import torch
from torch import nn

from rpc_backend import current_worker, run_local


def _checkpoint_after_last_step() -> tuple | None:
    from remote_module.ps import PSModel

    me = current_worker()
    if me.role == "ps":
        return None
    torch.manual_seed(0)
    model = PSModel(nn.Linear(4, 2), me.workers("ps"), name="ckpt", num_trainers=2, mode="sync", timeout=30)
    for i in range(3):
        if me.role_rank == 1 and i == 2:
            time.sleep(1.0)  # trainer1 pushes its last step late: trainer0 checkpoints first
        model(torch.ones(1, 4) * (me.role_rank + 1)).sum().backward()
        model.step()
    state = {k: v.tolist() for k, v in model.state_dict().items()}
    return state, {server: s["version"] for server, s in model.stats().items()}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sync_checkpoint_waits_for_own_last_step():
    results = run_local(_checkpoint_after_last_step, 4, roles={"ps": 2, "trainer": 2}, timeout=100)
    (state0, _), (state1, versions) = results[2], results[3]
    assert versions == {"ps0": 3, "ps1": 3}
    # the same 3 applied steps on both trainers (trainer0's used to be taken at step 2)
    assert state0 == state1
    # and equal to 3 local SGD steps on the averaged gradient (lr 0.1): d(sum(Wx+b))/dW = x
    torch.manual_seed(0)
    ref = nn.Linear(4, 2)
    with torch.no_grad():
        for _ in range(3):
            ref.weight -= 0.1 * (torch.ones(2, 4) * 1.5)
            ref.bias -= 0.1 * torch.ones(2)
    assert torch.allclose(torch.tensor(state0["weight"]), ref.weight, atol=1e-6)
    assert torch.allclose(torch.tensor(state0["bias"]), ref.bias, atol=1e-6)
