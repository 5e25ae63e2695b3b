"""Classes the host cannot import travel by value (cloudpickle); importable ones by reference."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.autograd as dist_autograd
from torch.distributed.optim import DistributedOptimizer

from remote_module import RemoteModule
from remote_module._shipping import ByValue, importable_by_reference, pack_constructor
from tests._remote import Affine

ROOT = Path(__file__).resolve().parent.parent


def test_what_goes_by_reference():
    class Local(torch.nn.Module):
        pass

    assert importable_by_reference(Affine)
    assert importable_by_reference(torch.nn.Linear)
    assert not importable_by_reference(Local)
    assert not importable_by_reference(lambda: Affine())
    Main = type("Main", (torch.nn.Module,), {"__module__": "__main__"})
    assert not importable_by_reference(Main)
    cls, args, kwargs = pack_constructor(Affine, (4,), {"seed": 1})
    assert (cls, args, kwargs) == (Affine, (4,), {"seed": 1})
    packed, args, kwargs = pack_constructor(Local, (), {})
    assert isinstance(packed, ByValue) and args == () and kwargs == {}
    assert packed.load()[0].__qualname__ == Local.__qualname__


def test_importable_class_with_a_local_argument_goes_by_value():
    class Config:
        n = 4

    packed, _, _ = pack_constructor(Affine, (Config(),), {})
    assert isinstance(packed, ByValue)


@pytest.mark.usefixtures("rpc_world")
def test_class_defined_inside_a_function_runs_and_trains_remotely():
    class Scaler(torch.nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.arange(float(n)))

        def forward(self, x: torch.Tensor, bias: float = 0.0) -> torch.Tensor:
            return x * self.w + bias

    proxy = RemoteModule("worker2/cpu", Scaler, (3,))
    assert proxy.remote_type.endswith("Scaler")
    x = torch.ones(3)
    assert proxy(x, bias=1.0).tolist() == [1.0, 2.0, 3.0]
    assert proxy.forward_async(x).wait().tolist() == [0.0, 1.0, 2.0]
    opt = DistributedOptimizer(torch.optim.SGD, proxy.remote_parameters(), lr=1.0)
    with dist_autograd.context() as ctx:
        dist_autograd.backward(ctx, [proxy(x).sum()])
        opt.step(ctx)
    assert proxy(x).tolist() == [-1.0, 0.0, 1.0]  # w - lr * d(sum)/dw = w - 1


def test_main_class_in_a_script_run_by_the_local_launcher():
    out = subprocess.run(
        [sys.executable, "tests/scripts/main_class_job.py"], cwd=ROOT, capture_output=True, text=True, timeout=150,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(next(l for l in out.stdout.splitlines() if l.startswith("RESULT "))[len("RESULT "):])
    assert result["out"] == [2.0, 2.0, 2.0]
    assert result["after"] == [1.5, 1.5, 1.5]  # w - 0.5 * 1
    assert result["type"].endswith("MainNet")
