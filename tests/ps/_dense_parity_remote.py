"""What tests/ps/test_dense_parity.py runs on its trainers: a PSModel used as a torch user uses a
local model (forwards before a backward while the servers move, steps without gradients,
non-contiguous parameters), each returning what pytest needs to compute the plain-torch
reference itself. PSModels are kept by job name in tests/ps/_dense_remote.py's registry."""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from tests.ps import _dense_remote as base


class Strided(nn.Module):
    """Parameters that are not contiguous, as local torch users make them: a ``channels_last``
    conv weight and a weight made with ``.t()``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3).to(memory_format=torch.channels_last)
        self.w = nn.Parameter(torch.randn(5, 6).t())  # shape (6, 5), strides (1, 6)
        self.b = nn.Parameter(torch.randn(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x)).mean(dim=(2, 3))  # (N, 4)
        return torch.cat([h, h[:, :2]], dim=1) @ self.w + self.b  # (N, 5)


class Sometimes(nn.Module):
    """``p`` used on every step, ``q`` only when asked (else its gradient stays None)."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(8))
        self.q = nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor, use_q: bool) -> torch.Tensor:
        out = (self.p * x).sum() ** 2
        return out + (self.q ** 2).sum() * x.mean() if use_q else out


def build(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return {"strided": Strided, "sometimes": Sometimes}[kind]()


def strided_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randn(3, 2, 5, 5, generator=g).to(memory_format=torch.channels_last)
    return x, torch.randn(3, 5, generator=g)


def sometimes_x(step: int) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, 8) * (1 + 0.1 * step)


#: each step of the no-gradient schedule: "all" (p and q get gradients), "p" (q's stays None),
#: "none" (step() without any gradient: no backward at all)
SCHEDULE = ["all", "none", "all", "p", "none", "all", "all", "none", "p"]


def create(job: str, kind: str, seed: int, servers: list[str], **kwargs: Any) -> list:
    """A PSModel of ``build(kind, seed)`` for ``job``; its layout as ``[(block name, server)]``."""
    from remote_module.ps import PSModel

    ps = PSModel(build(kind, seed), servers, name=job, **kwargs)
    base._models[job] = ps
    return [(s.name, s.server) for s in ps._slots]


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {k: None if v.grad is None else v.grad.clone() for k, v in model.named_parameters()}


def strided_train(job: str, steps: int) -> dict:
    """``steps`` MSE steps; the local parameters' strides, each step's gradients (before the
    push) and the servers' values after each step."""
    ps = base._models[job]
    grads, values = [], []
    for step in range(steps):
        x, y = strided_batch(step)
        nn.functional.mse_loss(ps(x), y).backward()
        grads.append(_grads(ps.module))
        ps.step()
        values.append({k: v.clone() for k, v in ps.state_dict().items()})  # not the live parameters
    return {"grads": grads, "values": values, "local": _params(ps.module),
            "strides": {k: v.stride() for k, v in ps.module.named_parameters()}}


def sometimes_train(job: str) -> dict:
    """The :data:`SCHEDULE`: the servers' values and optimizer state at the end, and the local copy."""
    ps = base._models[job]
    for step, kind in enumerate(SCHEDULE):
        if kind != "none":
            ps(sometimes_x(step), kind == "all").backward()
        ps.step()
    return {"values": {k: v.clone() for k, v in ps.state_dict().items()}, "local": _params(ps.module),
            "optim": ps.optimizer_state_dict()}


def two_forwards(job: str, seed: int, servers: list[str], kwargs: dict) -> dict:
    """Forward once, let the servers move (a second PSModel of the same job steps: the same
    trainer, attached again), forward again, then one backward of both outputs: the values
    each forward pulled and the gradients the parameters got."""
    from remote_module.ps import PSModel

    ps = base._models[job]
    other = PSModel(base.build("net", seed), servers, name=job, **kwargs)
    x1, y1 = base.batch(0, 0)
    x2, _ = base.batch(0, 1)
    out1 = ps(x1)
    first = _params(ps.module)
    nn.functional.mse_loss(other(x2), y1).backward()
    other.step()
    other.flush()  # (its push landed, and half_async applied it, before ps pulls in another message)
    out2 = ps(x2)
    second = _params(ps.module)
    (nn.functional.mse_loss(out1, y1) + (out2 * 3.0).tanh().sum()).backward()
    return {"first": first, "second": second, "grads": _grads(ps.module)}


def direct_graph_then_pull(job: str, seed: int, servers: list[str], kwargs: dict) -> dict:
    """A graph built on the local parameters themselves (``ps.module(x)``), then a pull that
    brings new values, then its backward: how the backward ends."""
    from remote_module.ps import PSModel

    ps = base._models[job]
    other = PSModel(base.build("net", seed), servers, name=job, **kwargs)
    x, y = base.batch(0, 0)
    out = ps.module(x)
    nn.functional.mse_loss(other(x), y).backward()
    other.step()
    ps.pull()
    return base._attempt(lambda: nn.functional.mse_loss(out, y).backward())



class Meeting(nn.Module):
    """``p.sum()`` (16 elements: gradient 1), whose forward makes two threads meet inside it:
    the first to enter waits (up to 2 s) for a second one inside, the second waits (up to 2 s)
    until the first's call returned (:meth:`finished`). Concurrent forwards that swap tensors
    on the module would then restore them in the wrong order; one at a time, each wait simply
    ends at its deadline."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.zeros(16))
        self.cv = threading.Condition()
        self.inside = self.done = 0

    def forward(self) -> torch.Tensor:
        with self.cv:
            self.inside += 1
            first = self.inside == 1
            self.cv.notify_all()
            if first:
                self.cv.wait_for(lambda: self.inside >= 2, timeout=2.0)
            else:
                self.cv.wait_for(lambda: self.done >= 1, timeout=2.0)
        return self.p.sum()

    def finished(self) -> None:
        with self.cv:
            self.done += 1
            self.cv.notify_all()


def threads_forward(job: str, servers: list[str]) -> dict:
    """Two threads each forward and backward one async PSModel of a :class:`Meeting` at once:
    whether the module still holds its own Parameter objects afterwards, and the gradient."""
    from remote_module.ps import PSModel

    ps = PSModel(Meeting(), servers, name=job, num_trainers=1, ps_mode="async")
    before = [id(q) for q in ps.parameters()]

    def run() -> None:
        out = ps()
        ps.module.finished()
        out.backward()

    base.in_threads(run, 2)
    return {"same": [id(q) for q in ps.parameters()] == before,
            "types": sorted({type(v).__name__ for v in ps.module._parameters.values()}),
            "grad": ps.module.p.grad.clone()}
