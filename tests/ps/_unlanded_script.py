"""Run by tests/ps/test_dense_faults.py in a process of its own: trainer0's last call on two
PSModels is a step() whose pushes fail, and nothing waits for them (no flush()). Local torch
would have raised at that step; here the failure must still reach the user, as a warning when
the process ends. One job's server-side optimizer refuses NaN gradients (async); the other is
a sync job for two trainers of which only this one pushes (its push is not applied in time)."""

from __future__ import annotations

import sys

import torch

from tests._deadlines import HANG_S, SETUP_S
from tests.ps._dense_remote import RefusingSGD  # (importable by the servers, which unpickle it)


def body() -> bool | None:
    from torch import nn

    from remote_module.ps import PSModel
    from rpc_backend import current_worker

    me = current_worker()
    if me.role != "trainer":
        return None
    servers = me.workers("ps")
    # (a hang guard: this push fails by the server's refusal, not by its timeout)
    refused = PSModel(nn.Linear(3, 1), servers, name="unlanded-nan", num_trainers=1, ps_mode="async",
                      optimizer=(RefusingSGD, {"lr": 0.1}), timeout=HANG_S)
    refused(torch.full((2, 3), float("nan"))).sum().backward()
    refused.step()  # fails on the server; nothing waits for it
    stalled = PSModel(nn.Linear(3, 1), servers, name="unlanded-sync", num_trainers=2, ps_mode="sync")
    stalled(torch.ones(2, 3)).sum().backward()
    stalled.timeout = 1.0  # (only the push expected to time out has it: built at any speed)
    stalled.step()  # the other trainer never pushes: not applied in time; nothing waits for it
    return True


if __name__ == "__main__":
    from rpc_backend import run_local

    print(run_local(body, 2, roles={"ps": 1, "trainer": 1}, rpc_timeout=SETUP_S))
    sys.stdout.flush()
