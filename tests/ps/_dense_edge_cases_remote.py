"""What tests/ps/test_dense_edge_cases.py runs on its trainers: models with the parameters ordinary users
have (a scalar, one used only on some steps, a frozen one, an integer one, tied weights) and the
attacks themselves, each returning its outcome to pytest."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.ps import _dense_remote as base


class Mixed(nn.Module):
    """``p`` (8), scalar ``s``, ``q`` used only when asked (float64 with ``double_q``), frozen
    ``f``; optionally an integer parameter ``i``, ``head`` tied to ``tail``, and a module
    registered under two names (``twice`` and ``again``, a weight-shared layer)."""

    def __init__(self, int_param: bool = False, tied: bool = False, double_q: bool = False,
                 shared: bool = False) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(8))
        self.s = nn.Parameter(torch.tensor(1.5))
        self.q = nn.Parameter(torch.randn(4, dtype=torch.float64 if double_q else torch.float32))
        self.f = nn.Parameter(torch.ones(4), requires_grad=False)
        if int_param:
            self.i = nn.Parameter(torch.arange(4), requires_grad=False)
        if tied:
            self.head = nn.Linear(4, 4, bias=False)
            self.tail = nn.Linear(4, 4, bias=False)
            self.tail.weight = self.head.weight
        if shared:
            self.twice = nn.Linear(4, 4)
            self.again = self.twice

    def forward(self, x: torch.Tensor, use_q: bool) -> torch.Tensor:
        out = (self.p * x).sum() * self.s + self.f.sum()
        if use_q:
            out = out + (self.q ** 2).sum()
        if hasattr(self, "head"):
            out = out + self.tail(self.head(x[:4])).sum()
        if hasattr(self, "twice"):
            out = out + self.again(torch.tanh(self.twice(x[:4]))).sum()
        return out


def build(seed: int, **kwargs: Any) -> Mixed:
    torch.manual_seed(seed)
    return Mixed(**kwargs)


def x_of(step: int) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, 8) + 0.1 * step


def uses_q(step: int) -> bool:
    return step % 3 == 0  # q has a gradient on steps 0, 3, ... only


def create(job: str, seed: int, servers: list[str], model_kwargs: dict | None = None, **kwargs: Any) -> list:
    from remote_module.ps import PSModel

    ps = PSModel(build(seed, **(model_kwargs or {})), servers, name=job, **kwargs)
    base._models[job] = ps
    return [(s.name, s.server) for s in ps._slots]


def try_create(*args: Any, **kwargs: Any) -> dict:
    return base._attempt(lambda: create(*args, **kwargs))


def train(job: str, steps: int, start: int = 0) -> int:
    ps = base._models[job]
    for step in range(start, start + steps):
        (ps(x_of(step), uses_q(step)) ** 2).backward()
        ps.step()
    return steps


def partial_load(job: str, keys: list[str]) -> dict:
    """The servers' values, then ``load_state_dict`` of zeros for ``keys`` only (strict=False),
    then the servers' values again and the load's result."""
    ps = base._models[job]
    before = {k: v.clone() for k, v in ps._server_values().items()}
    shapes = dict(ps.module.named_parameters())
    result = ps.load_state_dict({k: torch.zeros_like(shapes[k]) for k in keys}, strict=False)
    after = ps._server_values()
    return {"before": before, "after": after, "missing": list(result.missing_keys)}


def try_load_optimizer(job: str, state: dict) -> dict:
    return base._attempt(lambda: base._models[job].load_optimizer_state_dict(state))


def try_train(job: str, steps: int, start: int = 0) -> dict:
    return base._attempt(lambda: train(job, steps, start))


def timed(job: str, what: str) -> dict:
    """``pull`` or ``step`` (after a forward and backward) of ``job``: its outcome. A step
    returns with its pushes in flight: ``flush()`` lands them (a failure raises there)."""
    ps = base._models[job]
    if what == "step":
        (ps.module(x_of(0), uses_q(0)) ** 2).backward()  # step 0's gradients (the first pull was at creation)
    return base._attempt({"pull": ps.pull, "step": lambda: (ps.step(), ps.flush())}[what])


def retry_step(job: str) -> dict:
    """``step()`` again with the gradients a failed ``step()`` left."""
    return base._attempt(base._models[job].step)


def all_on_first(block_names: list[str], servers: list[str]) -> list[str]:
    """A split_method leaving every server but the first without blocks."""
    return [servers[0]] * len(block_names)


def threads_push(job: str, threads: int, steps: int, **kwargs: Any) -> int:
    """``threads`` threads of this trainer, each with its own PSModel of ``job`` (a ``linear``
    model, gradient 1), each pushing ``steps`` times at once; the pushes made."""
    import threading

    from remote_module.ps import PSModel

    start = threading.Barrier(threads)

    def run() -> None:
        ps = PSModel(base.build("linear", 0), ["ps0", "ps1"], name=job, **kwargs)
        start.wait()
        for _ in range(steps):
            ps().backward()
            ps.step()

    base.in_threads(run, threads)
    return threads * steps


def messages(job: str) -> dict:
    """Messages a PSModel sends to each server for a forward (its pull) and for a step,
    counted at rpc_async, and the tensors a step's pushes carry (gradients), per server."""
    import torch.distributed.rpc as rpc

    from tests.benchmarks._common import messages_per_call

    ps = base._models[job]
    out: dict = {"tensors": {}}
    out["forward"] = messages_per_call(lambda: out.update(loss=ps(x_of(0), True)), 1)
    (out.pop("loss") ** 2).backward()
    real = rpc.rpc_async

    def tensors(value: Any) -> int:
        if isinstance(value, torch.Tensor):
            return 1
        if isinstance(value, (list, tuple)):
            return sum(map(tensors, value))
        if isinstance(value, dict):
            return sum(map(tensors, value.values()))
        return 0

    def counting(to: Any, fn: Any, args: tuple = (), *rest: Any, **kwargs: Any) -> Any:
        out["tensors"][str(to.name if isinstance(to, rpc.WorkerInfo) else to)] = tensors(args)
        return real(to, fn, args, *rest, **kwargs)

    rpc.rpc_async = counting
    try:
        out["step"] = messages_per_call(ps.step, 1)
    finally:
        rpc.rpc_async = real
    return out


_held: dict[str, Any] = {}


def hold_pushes(job: str, seconds: float) -> None:
    """(On a server) from now on, each push of ``job`` waits until a trainer has attached to
    ``job`` again (answered first) or ``seconds`` passed: a push still in flight when a
    rebuilt PSModel attaches, whatever the machine's speed. :func:`release_pushes` undoes it."""
    import threading

    from remote_module.ps.dense import _server

    attached = threading.Event()
    push, attach = _server._push, _server._attach
    _held.update(push=push, attach=attach)

    def held_push(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == job:
            attached.wait(seconds)
        return push(name, *args, **kwargs)

    def seen_attach(name: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return attach(name, *args, **kwargs)
        finally:
            if name == job:
                attached.set()

    _server._push, _server._attach = held_push, seen_attach


def release_pushes() -> None:
    from remote_module.ps.dense import _server

    _server._push, _server._attach = _held.pop("push"), _held.pop("attach")
