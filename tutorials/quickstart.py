"""Quickstart: a remote Linear layer, called like a local one, on a local two-process world.

    python tutorials/quickstart.py

The same code runs across machines: start each worker with rpc.init_rpc (or under torchrun)
instead of rpc_backend.run_local.
"""

import torch
import torch.distributed.rpc as rpc

from remote_module import RemoteModule
from rpc_backend import run_local


def main() -> list | None:
    if rpc.get_worker_info().name != "worker0":
        return None  # worker1 only hosts the module; it runs no code of its own
    linear = RemoteModule("worker1/cpu", torch.nn.Linear, args=(20, 30))
    with torch.no_grad():  # inference (training goes through dist_autograd: tutorials/pipeline.py)
        out = linear(torch.randn(128, 20))  # runs on worker1
        later = linear.forward_async(torch.randn(4, 20))  # returns at once
    return [tuple(out.shape), tuple(later.wait().shape), len(linear.remote_parameters())]


if __name__ == "__main__":
    print(run_local(main, 2)[0])
