"""A script whose module class lives in __main__ (run by tests/proxy/test_shipping.py):

    python tests/proxy/scripts/main_class_job.py

Creates the class on another local process, runs forward, trains one step, prints RESULT.
"""

import json

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch.distributed.optim import DistributedOptimizer

from remote_module import RemoteModule
from rpc_backend import run_local
from tests._deadlines import SETUP_S


class MainNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((3,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def main() -> dict | None:
    if rpc.get_worker_info().id != 0:
        return None
    net = RemoteModule("worker1/cpu", MainNet)
    x = torch.ones(3)
    out = net(x).tolist()
    opt = DistributedOptimizer(torch.optim.SGD, net.remote_parameters(), lr=0.5)
    with dist_autograd.context() as ctx:
        dist_autograd.backward(ctx, [net(x).sum()])
        opt.step(ctx)
    return {"out": out, "after": net(x).tolist(), "type": net.remote_type}


if __name__ == "__main__":
    print("RESULT " + json.dumps(run_local(main, 2, rpc_timeout=SETUP_S, timeout=SETUP_S)[0]))
