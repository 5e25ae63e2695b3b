"""Gradient clipping of a model holding proxies, trained in a distributed autograd context.

There ``dist_autograd.backward`` keeps the gradients in the context, not in ``.grad``: torch's
``clip_grad_norm_`` finds none and clips nothing. ``remote_module.clip_grad_norm_`` clips the
context's gradients as local torch clips ``.grad`` (the local twin of each model is the
specification), and reading a proxy handle's ``.grad`` inside a context warns once.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.optim import DistributedOptimizer

import remote_module
from remote_module import RemoteModule
from remote_module._proxy import context_grads
from tests.proxy import _context_grads_remote

pytestmark = pytest.mark.usefixtures("rpc_world")


class Net(nn.Module):
    def __init__(self, mid: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.mid = mid
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def twins(seed: int = 0) -> tuple[Net, Net]:
    """A local model and the same model with ``mid`` on worker1 and ``head`` on worker2."""
    torch.manual_seed(seed)
    local = Net(nn.Linear(6, 6), nn.Linear(6, 2))
    hybrid = Net(RemoteModule("worker1/cpu", nn.Linear, (6, 6)), RemoteModule("worker2/cpu", nn.Linear, (6, 2)))
    hybrid.load_state_dict(local.state_dict())
    return local, hybrid


def optimizer_params(hybrid: Net) -> list:
    local = [rpc.RRef(p) for p in hybrid.inp.parameters()]
    return local + hybrid.mid.remote_parameters() + hybrid.head.remote_parameters()


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 4, generator=g) * 3, torch.randn(8, 2, generator=g) * 3) for _ in range(n)]


def train_local(model: Net, data: list, max_norm: float, norm_type: float) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    norms = []
    for x, y in data:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)))
        opt.step()
    return norms


def train_hybrid(model: Net, data: list, clip) -> list[float]:
    opt = DistributedOptimizer(torch.optim.SGD, optimizer_params(model), lr=0.5)
    norms = []
    for x, y in data:
        with dist_autograd.context() as ctx:
            dist_autograd.backward(ctx, [nn.functional.mse_loss(model(x), y)])
            norms.append(float(clip(ctx)))
            opt.step(ctx)
    return norms


def assert_same_params(hybrid: Net, local: Net) -> None:
    got, want = hybrid.state_dict(), local.state_dict()
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clipping_a_hybrid_model_trains_as_local_torch_clips(norm_type):
    local, hybrid = twins()
    data = batches(4)
    max_norm = 0.05  # below every step's norm: each step is clipped
    want = train_local(local, data, max_norm, norm_type)
    got = train_hybrid(hybrid, data, lambda ctx: remote_module.clip_grad_norm_(
        ctx, hybrid.parameters(), max_norm, norm_type))
    assert min(want) > max_norm
    assert got == pytest.approx(want, rel=1e-5)
    assert_same_params(hybrid, local)


def test_the_optimizers_list_and_the_model_clip_alike_and_a_large_max_norm_changes_nothing():
    local, hybrid = twins(seed=1)
    data = batches(3)
    want = train_local(local, data, 0.1, 2.0)
    # the list given to DistributedOptimizer (local RRefs, remote parameters' RRefs), then the module itself
    clips = iter([lambda ctx: remote_module.clip_grad_norm_(ctx, optimizer_params(hybrid), 0.1),
                  lambda ctx: remote_module.clip_grad_norm_(ctx, hybrid, 0.1),
                  lambda ctx: remote_module.clip_grad_norm_(ctx, list(hybrid.parameters()), 0.1)])
    got = train_hybrid(hybrid, data, lambda ctx: next(clips)(ctx))
    assert got == pytest.approx(want, rel=1e-5)
    assert_same_params(hybrid, local)
    # above the norm: the gradients are left as they are, as torch leaves them
    local, hybrid = twins(seed=2)
    want = train_local(local, data, 1e9, 2.0)
    got = train_hybrid(hybrid, data, lambda ctx: remote_module.clip_grad_norm_(ctx, hybrid.parameters(), 1e9))
    assert got == pytest.approx(want, rel=1e-5)
    assert_same_params(hybrid, local)


def test_a_module_the_forward_did_not_reach_and_a_shared_module_count_as_locally():
    torch.manual_seed(3)
    local = nn.ModuleDict({"a": nn.Linear(3, 3), "unused": nn.Linear(3, 3)})
    a = RemoteModule("worker1/cpu", nn.Linear, (3, 3))
    hybrid = nn.ModuleDict({
        "a": a,
        "again": RemoteModule.init_from_module_rref("worker1/cpu", a.get_module_rref()),  # the same module
        "unused": RemoteModule("worker2/cpu", nn.Linear, (3, 3)),  # worker2 never joins the context
    })
    hybrid.load_state_dict({**local.state_dict(), **{f"again.{k}": v for k, v in local["a"].state_dict().items()}})
    x = torch.randn(5, 3)
    local["a"](x).pow(2).sum().backward()
    want = nn.utils.clip_grad_norm_(local.parameters(), 0.5)
    with dist_autograd.context() as ctx:
        dist_autograd.backward(ctx, [hybrid["a"](x).pow(2).sum()])
        got = remote_module.clip_grad_norm_(ctx, hybrid.parameters(), 0.5)
        clipped = rpc.rpc_sync("worker1", _context_grads_remote.context_grads, (ctx, a.get_module_rref()))
    torch.testing.assert_close(got, want)
    for g, p in zip(clipped, local["a"].parameters()):
        torch.testing.assert_close(g, p.grad)


def test_a_nonfinite_norm_is_refused_before_anything_is_scaled():
    _, hybrid = twins()
    x = torch.randn(2, 4)
    x[0, 0] = math.inf
    with dist_autograd.context() as ctx:
        dist_autograd.backward(ctx, [hybrid(x).sum() * 1e38 * 1e38])
        before = rpc.rpc_sync("worker1", _context_grads_remote.context_grads, (ctx, hybrid.mid.get_module_rref()))
        local_before = [dist_autograd.get_gradients(ctx)[p].clone() for p in hybrid.inp.parameters()]
        with pytest.raises(RuntimeError, match="is non-finite, so it cannot be clipped"):
            remote_module.clip_grad_norm_(ctx, hybrid.parameters(), 1.0, error_if_nonfinite=True)
        after = rpc.rpc_sync("worker1", _context_grads_remote.context_grads, (ctx, hybrid.mid.get_module_rref()))
        local_after = [dist_autograd.get_gradients(ctx)[p] for p in hybrid.inp.parameters()]
    for b, a in zip(before + local_before, after + local_after):
        assert torch.equal(b.nan_to_num(), a.nan_to_num())


def test_a_context_that_is_not_live_is_named():
    _, hybrid = twins()
    with dist_autograd.context() as ctx:
        dist_autograd.backward(ctx, [hybrid(torch.randn(2, 4)).sum()])
    with pytest.raises(RuntimeError, match=f"no distributed autograd context {ctx}"):
        remote_module.clip_grad_norm_(ctx, hybrid.parameters(), 1.0)
    with dist_autograd.context() as ctx2:
        with pytest.raises(TypeError, match="takes a module, or parameters"):
            remote_module.clip_grad_norm_(ctx2, ["weight"], 1.0)


def test_torchs_clip_in_a_context_warns_once_and_reading_grad_outside_one_is_silent(monkeypatch):
    monkeypatch.setattr(context_grads, "_warned", False)
    local, hybrid = twins()
    x, y = batches(1)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # outside a context: no warning from any .grad reader
        with torch.no_grad():
            hybrid(x)
        opt = torch.optim.SGD(hybrid.parameters(), lr=0.1)
        hybrid.zero_grad()
        opt.zero_grad()
        opt.step()
        assert nn.utils.clip_grad_norm_(hybrid.parameters(), 1.0) == 0
        assert hybrid.mid.remote_requires_grad.grad is None
        dist_opt = DistributedOptimizer(torch.optim.SGD, optimizer_params(hybrid), lr=0.1)
        with dist_autograd.context() as ctx:  # the optimizer's own step reads no handle
            dist_autograd.backward(ctx, [nn.functional.mse_loss(hybrid(x), y)])
            dist_opt.step(ctx)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with dist_autograd.context() as ctx:
            dist_autograd.backward(ctx, [nn.functional.mse_loss(hybrid(x), y)])
            assert nn.utils.clip_grad_norm_(hybrid.parameters(), 1.0) == 0  # torch's finds nothing
            nn.utils.clip_grad_norm_(hybrid.parameters(), 1.0)
    mine = [w for w in caught if "remote_module.clip_grad_norm_" in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    assert mine[0].category is UserWarning and mine[0].filename == __file__
    assert "dist_autograd.get_gradients(ctx)" in str(mine[0].message)
