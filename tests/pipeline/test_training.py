"""Training a RemotePipeline with distributed autograd: every stage's gradients, and
DistributedOptimizer steps, equal local autograd on the same weights; the caller's grad mode
reaches the hosts."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.autograd as dist_autograd
from torch import nn
from torch.distributed.optim import DistributedOptimizer

from remote_module.pipeline import RemotePipeline, split_sequential
from tests.pipeline import _remote as remote
from tests.pipeline._remote import Fork, GradProbe, Heads, Join, on_host, recorded

pytestmark = pytest.mark.usefixtures("rpc_world")

W1, W2 = "worker1/cpu", "worker2/cpu"


@pytest.fixture(autouse=True)
def _same_inputs_every_run():
    torch.manual_seed(0)


def mlp() -> nn.Sequential:
    g = torch.Generator().manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12),
                          nn.Linear(12, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def data(*shapes: tuple[int, ...], seed: int = 3) -> list[torch.Tensor]:
    """Inputs in [-1, 1) from ``seed``: gradients of order 1, so atol 1e-5 compares them."""
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(shape, generator=g) * 2 - 1 for shape in shapes]


def loss_of(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _named(name: str):
    """assert_close's message: ``name`` before torch's (which says by how much they differ)."""
    return lambda message: f"{name}: {message}"


def stripped(state: dict) -> dict:
    """``stages.<i>.<key>`` -> ``<key>``."""
    assert all(k.startswith("stages.") for k in state)
    return {k.split(".", 2)[2]: v for k, v in state.items()}


def joint_loss(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a**2).mean() + b.mean()


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_backward_reaches_every_stage_with_local_gradients(chunks):
    model = mlp()
    pipe = split_sequential(model, [W1, W2, W1], balance=[2, 2, 2], chunks=chunks)
    x, target = data((10, 6), (10, 2))
    with dist_autograd.context() as ctx:
        loss = loss_of(pipe(x), target)
        dist_autograd.backward(ctx, [loss])
        remote_grads = {}
        for stage in pipe.stages:
            remote_grads.update(on_host(stage, remote.gradients, ctx))
    loss_of(model(x), target).backward()
    local_grads = {name: p.grad for name, p in model.named_parameters()}
    assert sorted(remote_grads) == sorted(local_grads)  # every parameter of every stage, by its own name
    for name, grad in local_grads.items():
        assert remote_grads[name] is not None, f"backward did not reach {name}"
        torch.testing.assert_close(remote_grads[name], grad, atol=1e-5, rtol=0, msg=_named(name))


def test_backward_through_tuple_outputs_and_a_tuple_last_stage():
    pipe = RemotePipeline([(W1, Fork, (4, 30), None), (W2, Join, (4, 5, 31), None), (W1, Heads, (5, 32), None)],
                          chunks=3)
    local = [Fork(4, 30), Join(4, 5, 31), Heads(5, 32)]
    (x,) = data((7, 4))
    with dist_autograd.context() as ctx:
        first, second = pipe(x)
        dist_autograd.backward(ctx, [joint_loss(first, second)])
        remote_grads = [on_host(stage, remote.gradients, ctx) for stage in pipe.stages]
    a, b = local[2](local[1](*local[0](x)))
    joint_loss(a, b).backward()
    for module, grads in zip(local, remote_grads):
        for name, p in module.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=0, msg=_named(name))


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_distributed_optimizer_steps_like_a_local_optimizer(chunks):
    model = mlp()
    pipe = split_sequential(model, [W1, W2], chunks=chunks)
    opt = DistributedOptimizer(torch.optim.SGD, pipe.remote_parameters(), lr=0.1, momentum=0.5)
    local_opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    for step in range(3):
        x, target = data((8, 6), (8, 2), seed=step)
        with dist_autograd.context() as ctx:
            dist_autograd.backward(ctx, [loss_of(pipe(x), target)])
            opt.step(ctx)
        local_opt.zero_grad()
        loss_of(model(x), target).backward()
        local_opt.step()
    trained = stripped(pipe.state_dict())
    assert sorted(trained) == sorted(model.state_dict())
    for name, value in model.state_dict().items():
        torch.testing.assert_close(trained[name], value, atol=1e-5, rtol=0, msg=_named(name))
    assert not torch.allclose(trained["0.weight"], mlp()[0].weight)  # the steps did change it
    assert len(pipe.remote_parameters()) == len(list(model.parameters()))


# ---- grad mode ---------------------------------------------------------------------------------


def test_the_callers_grad_mode_reaches_the_hosts():
    pipe = RemotePipeline([(W1, GradProbe, (3, 40), None), (W2, GradProbe, (3, 41), None)], chunks=2)
    x = torch.randn(4, 3)
    with torch.no_grad():
        out = pipe(x)
    assert not out.requires_grad
    for stage in pipe.stages:  # the hosts ran without grad and built no graph
        assert on_host(stage, recorded, "calls") == [(False, False)] * 2
    with dist_autograd.context():
        out = pipe(x)
    assert out.requires_grad and out.grad_fn is not None
    for stage in pipe.stages:
        assert on_host(stage, recorded, "calls")[2:] == [(True, True)] * 2
    with dist_autograd.context(), torch.no_grad():
        out = pipe(x)
    assert not out.requires_grad
    for stage in pipe.stages:
        assert on_host(stage, recorded, "calls")[4:] == [(False, False)] * 2


# ---- split_sequential passes and shares what nn.Sequential does (issue 20) -----------------------


def seeded(model: nn.Sequential, seed: int) -> nn.Sequential:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def shared_twice() -> nn.Sequential:
    """Layer 2 is layer 4 (one Linear used twice), the issue's ``Sequential(lin, Tanh(), lin)``
    inside a longer model so that there is something to cut."""
    lin = nn.Linear(8, 8)
    return seeded(nn.Sequential(nn.Linear(5, 8), nn.ReLU(), lin, nn.Tanh(), lin, nn.Linear(8, 2)), 7)


def tied() -> nn.Sequential:
    """Layer 4 holds layer 2's weight Parameter (tied weights), and nothing else of it."""
    lin = nn.Linear(5, 8)
    return seeded(nn.Sequential(nn.Linear(5, 5), nn.ReLU(), lin, nn.Tanh(), remote.Tied(lin), nn.Linear(5, 2)), 8)


def trained_like_local(model: nn.Sequential, pipe: RemotePipeline, steps: int = 3) -> None:
    """Train ``pipe`` (dist autograd, SGD) and ``model`` (local SGD) alike; their parameters
    stay equal (atol 1e-5) and their numbers of distinct parameters agree."""
    assert len(pipe.remote_parameters()) == len(list(model.parameters()))
    opt = DistributedOptimizer(torch.optim.SGD, pipe.remote_parameters(), lr=0.2)
    local_opt = torch.optim.SGD(model.parameters(), lr=0.2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for step in range(steps):
        x, target = data((6, 5), (6, 2), seed=10 + step)
        with dist_autograd.context() as ctx:
            out = pipe(x)
            local_opt.zero_grad()
            expected = model(x)
            torch.testing.assert_close(out, expected.detach(), atol=1e-5, rtol=0, msg=f"step {step}")
            dist_autograd.backward(ctx, [loss_of(out, target)])
            opt.step(ctx)
        loss_of(expected, target).backward()
        local_opt.step()
    trained = stripped(pipe.state_dict())
    assert sorted(trained) == sorted(model.state_dict())
    for name, value in model.state_dict().items():
        torch.testing.assert_close(trained[name], value, atol=1e-5, rtol=0, msg=_named(name))
        assert not torch.equal(value, before[name]), f"{name} did not train"


@pytest.mark.parametrize("make, devices, stages", [
    (shared_twice, [W1, W2], [["0", "1"], ["2", "3", "4", "5"]]),
    (shared_twice, [W1, W2, W1], [["0", "1"], ["2", "3", "4"], ["5"]]),
    (tied, [W1, W2], [["0", "1"], ["2", "3", "4", "5"]]),
])
def test_split_keeps_layers_that_share_state_on_one_stage_and_trains_like_the_local_model(make, devices, stages):
    model = make()
    pipe = split_sequential(model, devices, chunks=2)
    assert [on_host(stage, remote.child_names) for stage in pipe.stages] == stages
    trained_like_local(model, pipe)


def lstm_model() -> nn.Sequential:
    """The issue's case: an LSTM returns ``(output, (h, c))``; the next layer takes that tuple."""
    return seeded(
        nn.Sequential(nn.Linear(3, 4), nn.LSTM(4, 6, batch_first=True), remote.PickFirst(), nn.Linear(6, 2)), 9
    )


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("layers, devices, balance", [
    (lstm_model, [W1, W2], [2, 2]),  # the cut right after the LSTM
    (lambda: nn.Sequential(*lstm_model()[:2], nn.Identity(), *lstm_model()[2:]), [W1, W2, W1], [2, 1, 2]),  # two cuts
], ids=["one-cut", "two-cuts"])
def test_a_tuple_between_layers_crosses_a_cut_as_one_argument(layers, devices, balance, chunks):
    model = layers()
    pipe = split_sequential(model, devices, balance=balance, chunks=chunks)
    x, target = data((4, 3, 3), (4, 3, 2), seed=5)  # (batch, time, features), batch first
    with dist_autograd.context() as ctx:
        out = pipe(x)
        dist_autograd.backward(ctx, [loss_of(out, target)])
        remote_grads = {}
        for stage in pipe.stages:
            remote_grads.update(on_host(stage, remote.gradients, ctx))
    expected = model(x)
    torch.testing.assert_close(out, expected.detach(), atol=1e-5, rtol=0)
    loss_of(expected, target).backward()
    local_grads = dict(model.named_parameters())
    assert sorted(remote_grads) == sorted(local_grads)
    for name, p in local_grads.items():
        assert remote_grads[name] is not None, f"backward did not reach {name}"
        torch.testing.assert_close(remote_grads[name], p.grad, atol=1e-5, rtol=0, msg=_named(name))
