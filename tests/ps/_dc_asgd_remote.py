"""What the DC-ASGD tests run on their trainers (tests/ps/test_dc_asgd.py): PSModels kept by job
name between calls, so pytest can interleave two trainers' steps exactly."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.ps._dense_remote import IN, OUT, Net, batch

#: this process's (model, last gradients) by job name
_models: dict[str, Any] = {}


def build(name: str, lam: float, lr: float) -> dict[str, torch.Tensor]:
    """A ``Net`` (seed 0, as every trainer's) in an async PSModel on ps0 and ps1 with DC-ASGD's
    ``lam``; its values as pulled."""
    from remote_module.ps import PSModel

    torch.manual_seed(0)
    model = PSModel(Net(), ["ps0", "ps1"], name=name, num_trainers=2, ps_mode="async", dc_asgd=lam,
                    optimizer=(torch.optim.SGD, {"lr": lr}), min_block_size=4)
    _models[name] = model
    return {k: v.clone() for k, v in model.module.state_dict().items()}


def backward(name: str, trainer: int, step: int) -> dict[str, torch.Tensor]:
    """A forward (pulling the servers' values) and backward on this trainer's batch, no step:
    the values it used and its gradients."""
    model = _models[name]
    x, y = batch(trainer, step)
    loss = ((model(x) - y) ** 2).mean()
    used = {k: v.detach().clone() for k, v in model.module.named_parameters()}
    loss.backward()
    return {"used": used, "grads": {k: v.grad.clone() for k, v in model.module.named_parameters()}}


def step(name: str) -> None:
    _models[name].step()


def values(name: str) -> dict[str, torch.Tensor]:
    """The servers' current values (a pull)."""
    model = _models[name]
    model.pull()
    return {k: v.detach().clone() for k, v in model.module.named_parameters()}


def build_with(name: str, lam: float, lr: float, num_trainers: int, kind: str = "net",
               dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """:func:`build` with ``num_trainers`` trainers, a ``Net`` or a ``Linear`` (``kind``), in
    ``dtype``: its values as pulled."""
    from remote_module.ps import PSModel
    from tests.ps._dense_remote import build as build_module

    module = build_module(kind, 0)
    if dtype is not None:
        module = module.to(dtype)
    model = PSModel(module, ["ps0", "ps1"], name=name, num_trainers=num_trainers, ps_mode="async",
                    dc_asgd=lam, optimizer=(torch.optim.SGD, {"lr": lr}), min_block_size=4)
    _models[name] = model
    return {k: v.clone() for k, v in model.module.state_dict().items()}


def backward_linear(name: str, c: float) -> dict[str, torch.Tensor]:
    """A ``Linear`` model's forward and backward of ``(p * c).sum()`` (its gradient: ``c``)."""
    model = _models[name]
    p = model.module.p
    model(torch.full(p.shape, c, dtype=p.dtype)).backward()
    return {"p": p.grad.clone()}


def build_complex(name: str, lam: float, lr: float) -> dict[str, torch.Tensor]:
    """:func:`build` with complex64 parameters (nonzero imaginary parts): its values as pulled."""
    from remote_module.ps import PSModel

    torch.manual_seed(0)
    net = Net().to(torch.complex64)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1j * torch.randn(p.shape))
    model = PSModel(net, ["ps0", "ps1"], name=name, num_trainers=2, ps_mode="async", dc_asgd=lam,
                    optimizer=(torch.optim.SGD, {"lr": lr}), min_block_size=4)
    _models[name] = model
    return {k: v.clone() for k, v in model.module.state_dict().items()}


def backward_complex(name: str, trainer: int, step: int) -> dict[str, torch.Tensor]:
    """:func:`backward` of a complex model: a real loss, ``|model(x) - y| ** 2`` averaged."""
    model = _models[name]
    x, y = batch(trainer, step)
    x2, y2 = batch(trainer + 10, step)
    loss = (model(torch.complex(x, x2)) - torch.complex(y, y2)).abs().pow(2).mean()
    loss.backward()
    return {"grads": {k: v.grad.clone() for k, v in model.module.named_parameters()}}


def between(name: str, what: str) -> None:
    """What a trainer may do between its backward and its step: a checkpoint, a pull, an
    evaluation forward (no_grad)."""
    model = _models[name]
    if what == "state_dict":
        model.state_dict()
    elif what == "pull":
        model.pull()
    elif what == "optimizer_state_dict":
        model.optimizer_state_dict()
    elif what == "eval":
        with torch.no_grad():
            model(batch(0, 0)[0])
    else:
        raise ValueError(what)


def load(name: str, state: dict[str, torch.Tensor]) -> None:
    _models[name].load_state_dict(state)


# ---- the tutorial model, trained by two trainers at once -----------------------------------------

HIDDEN, CLASSES, FEATURES = 32, 10, 64


def _data(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Class prototypes plus noise (as the RPC parameter-server tutorial's stand-in data)."""
    g = torch.Generator().manual_seed(12345)
    prototypes = torch.randn(CLASSES, FEATURES, generator=g)
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    return prototypes[y] + 0.5 * torch.randn(n, FEATURES, generator=g), y


def train_tutorial(name: str, trainer: int, steps: int, lam: float | None) -> dict[str, float]:
    """The tutorial's model (Linear + ReLU + Linear, cross-entropy, SGD), async on ps0 and ps1,
    with ``dc_asgd=lam``: the loss on a fixed batch before and after ``steps`` steps."""
    from remote_module.ps import PSModel

    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))
    model = PSModel(net, ["ps0", "ps1"], name=name, num_trainers=2, ps_mode="async", dc_asgd=lam,
                    optimizer=(torch.optim.SGD, {"lr": 0.05}), min_block_size=64)
    x_eval, y_eval = _data(99, 256)
    with torch.no_grad():
        before = float(nn.functional.cross_entropy(model(x_eval), y_eval))
    for k in range(steps):
        x, y = _data(1000 * trainer + k, 32)
        nn.functional.cross_entropy(model(x), y).backward()
        model.step()
    model.flush()
    model.pull()
    with torch.no_grad():
        after = float(nn.functional.cross_entropy(model(x_eval), y_eval))
    return {"before": before, "after": after}


assert IN and OUT  # (the Net's sizes, shared with pytest's reference)
