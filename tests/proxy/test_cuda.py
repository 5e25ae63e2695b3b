"""CUDA behaviour on a real GPU. Skips cleanly without CUDA; the same logic is covered on the
CPU by tests/core/test_device.py."""

import pytest
import torch

from rpc_backend import run_local
from tests._deadlines import SETUP_S
from tests.proxy import _cuda_remote

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_outputs_come_back_on_cpu_without_device_map():
    result = run_local(_cuda_remote.check_without_device_map, 2, rpc_timeout=SETUP_S, timeout=SETUP_S)[0]
    assert result["single"] == ("Tensor", "cpu", (3, 4))  # one tensor, not split into rows
    assert result["async"] == "cpu"
    assert result["nested"] == ["cpu", "cpu", "cpu"]
    assert result["is_device_map_set"] is False


def test_outputs_stay_on_cuda_with_device_map():
    maps = {"worker0": {"worker1": {"cuda:0": "cuda:0"}}, "worker1": {"worker0": {"cuda:0": "cuda:0"}}}
    result = run_local(_cuda_remote.check_with_device_map, 2, rpc_timeout=SETUP_S, timeout=SETUP_S,
                       device_maps=maps)[0]
    assert result == {"is_device_map_set": True, "device": "cuda", "async": "cuda"}
