"""Rank functions for the CUDA tests (run with rpc_backend.run_local)."""

import torch
import torch.distributed.rpc as rpc

from remote_module import RemoteModule
from tests.proxy._remote import Nested


def check_without_device_map() -> dict:
    if rpc.get_worker_info().id != 0:
        return {}
    lin = RemoteModule("worker1/cuda:0", torch.nn.Linear, (4, 4))
    out = lin(torch.ones(3, 4))
    nested = RemoteModule("worker1/cuda:0", Nested)({"x": torch.ones(2), "ys": [torch.ones(1)]})
    return {
        "single": (type(out).__name__, out.device.type, tuple(out.shape)),
        "async": lin.forward_async(torch.ones(3, 4)).wait().device.type,
        "nested": [nested.first.device.type, nested.second[0].device.type, nested.second[1]["y"].device.type],
        "is_device_map_set": lin.is_device_map_set,
    }


def check_with_device_map() -> dict:
    if rpc.get_worker_info().id != 0:
        return {}
    lin = RemoteModule("worker1/cuda:0", torch.nn.Linear, (4, 4))
    out = lin(torch.ones(3, 4, device="cuda:0"))
    return {
        "is_device_map_set": lin.is_device_map_set,
        "device": out.device.type,
        "async": lin.forward_async(torch.ones(3, 4)).wait().device.type,
    }
