"""What the parameter-server tests run on their trainers (tests/ps/_world.py sends these by RPC):
models and batches that pytest rebuilds for its local references, and each trainer's PSModels
kept by job name between calls."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import torch
from torch import nn

IN, HIDDEN, OUT = 6, 5, 3
ROWS = 4  # rows of one trainer's batch

#: this process's PSModels by job name
_models: dict[str, Any] = {}


class Net(nn.Module):
    """A small MLP; its weights split into row blocks over 2 or 3 servers at min_block_size 4."""

    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN, hidden)
        self.fc2 = nn.Linear(hidden, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class Linear(nn.Module):
    """``(p * c).sum()``: its gradient is ``c`` (all ones without ``c``)."""

    def __init__(self, n: int = 16) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.zeros(n))

    def forward(self, c: torch.Tensor | None = None) -> torch.Tensor:
        return self.p.sum() if c is None else (self.p * c).sum()


def build(kind: str, seed: int, **kwargs: Any) -> nn.Module:
    torch.manual_seed(seed)
    return {"net": Net, "linear": Linear}[kind](**kwargs)


def batch(trainer: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer ``trainer``'s batch for ``step`` (the same in every process)."""
    g = torch.Generator().manual_seed(1000 * trainer + step)
    return torch.randn(ROWS, IN, generator=g), torch.randn(ROWS, OUT, generator=g)


def ready(server: bool) -> str:
    """Import what the jobs use before any timed call: remote_module.ps, and on servers torch.optim's
    first optimizer (its constructor imports torch._dynamo: ~2 s of CPU, past a short job timeout;
    trainers build one only in geo mode). Servers record their sync waits that reach their
    deadline from now on (tests/ps/_stalls.py)."""
    import torch.distributed.rpc as rpc

    import remote_module.ps  # noqa: F401

    if server:
        from tests.ps import _stalls

        torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
        _stalls.record()
    return rpc.get_worker_info().name


def _attempt(fn) -> dict:
    start = time.monotonic()
    try:
        value = fn()
    except Exception as exc:
        return {"ok": False, "type": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start}
    return {"ok": True, "value": value, "seconds": time.monotonic() - start}


# ---- jobs ----------------------------------------------------------------------------------------


def create(job: str, kind: str, seed: int, servers: list[str], model_kwargs: dict | None = None, **kwargs: Any):
    """A PSModel of ``build(kind, seed)`` for ``job``; its layout as ``[(block name, server)]``."""
    from remote_module.ps import PSModel

    ps = PSModel(build(kind, seed, **(model_kwargs or {})), servers, name=job, **kwargs)
    _models[job] = ps
    return [(s.name, s.server) for s in ps._slots]


def create_on(names: list[str], job: str, args: tuple, kwargs: dict) -> dict:
    """(On the driver) every trainer of ``names`` creates its PSModel of ``job`` at once
    (:func:`create`); their layouts by trainer."""
    import torch.distributed.rpc as rpc

    futs = [rpc.rpc_async(t, create, (job, *args), kwargs) for t in names]
    return {t: f.wait() for t, f in zip(names, futs)}


def try_create(*args: Any, **kwargs: Any) -> dict:
    """:func:`create`, its outcome (an expected error as type and message)."""
    return _attempt(lambda: create(*args, **kwargs))


def train(job: str, trainer: int, steps: int, start: int = 0) -> int:
    """``steps`` MSE steps of ``job`` on this trainer's batches ``start ..``."""
    ps = _models[job]
    for step in range(start, start + steps):
        x, y = batch(trainer, step)
        nn.functional.mse_loss(ps(x), y).backward()
        ps.step()
    ps._wait_pushes()  # (async: landed before returning, so another trainer's next read sees them)
    return steps


def train_counted(job: str, trainer: int, steps: int) -> dict:
    """:func:`train`, counting the messages this trainer sent to each server meanwhile."""
    from tests.benchmarks._common import messages_per_call

    return messages_per_call(lambda: train(job, trainer, steps), 1)


def train_clamped(job: str, trainer: int, steps: int, bound: float) -> dict:
    """:func:`train`, clamping every parameter to ``[-bound, bound]`` right after each
    ``step()`` (WGAN's weight clipping): the servers' state after."""
    ps = _models[job]
    for step in range(steps):
        x, y = batch(trainer, step)
        nn.functional.mse_loss(ps(x), y).backward()
        ps.step()
        with torch.no_grad():
            for p in ps.module.parameters():
                p.clamp_(-bound, bound)
    return state(job)


def wrapped_checkpoint(job: str) -> dict:
    """A PSModel inside a user's module (beside a local head), trained a step, saved with the
    holder's ``state_dict()`` and loaded strictly into a holder of another job: the keys, the
    second job's servers' state and head, and the first's."""
    from remote_module.ps import PSModel

    def holder(name: str, seed: int) -> nn.Module:
        model = nn.Module()
        model.ps = PSModel(build("net", seed), ["ps0", "ps1"], name=name, num_trainers=1, ps_mode="async",
                           min_block_size=1)
        torch.manual_seed(seed)
        model.head = nn.Linear(OUT, 1)
        return model

    first = holder(job + "-a", 1)
    x, y = batch(0, 0)
    nn.functional.mse_loss(first.ps(x), y).backward()
    first.ps.step()
    saved = first.state_dict()
    second = holder(job + "-b", 2)
    result = second.load_state_dict(saved)
    return {"keys": sorted(saved), "missing": list(result.missing_keys), "unexpected": list(result.unexpected_keys),
            "loaded": second.ps.state_dict(), "saved": first.ps.state_dict(),
            "head": torch.equal(second.head.weight, first.head.weight)}


class RefusingSGD(torch.optim.SGD):
    """SGD that refuses (raises at) a step with a NaN gradient, on the server."""

    def step(self, closure=None):  # noqa: ANN001, ANN201
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and bool(torch.isnan(p.grad).any()):
                    raise ValueError("RefusingSGD: a NaN gradient")
        return super().step(closure)


def refused_then_retried(job: str, trainer: int, nan: bool) -> dict:
    """sync: step 0 with this trainer's batch (NaN inputs with ``nan``), which the servers'
    optimizer refuses; the outcome of landing it; then ``zero_grad()`` and step 0 again with
    the true batch (the retry the error asks for). The servers' state after."""
    ps = _models[job]
    x, y = batch(trainer, 0)
    nn.functional.mse_loss(ps(x * float("nan") if nan else x), y).backward()
    ps.step()
    first = _attempt(ps.flush)
    ps.zero_grad()
    train(job, trainer, 1)
    return {"first": first, "state": state(job)}


def push_linear(job: str, steps: int, c: list[float] | None = None) -> int:
    """``steps`` steps of a ``linear`` job: each pushes the gradient ``c`` (ones without it)."""
    ps = _models[job]
    for _ in range(steps):
        ps(None if c is None else torch.tensor(c)).backward()
        ps.step()
    ps._wait_pushes()  # (as train)
    return steps


def state(job: str) -> dict:
    """``PSModel.state_dict()``: the servers' parameters under the model's own keys."""
    return dict(_models[job].state_dict())


def local(job: str) -> dict:
    """This trainer's local parameters, as they are (no pull)."""
    return {k: v.detach().clone() for k, v in _models[job].module.state_dict().items()}


def pulled(job: str) -> dict:
    """``pull()``, then the local parameters."""
    _models[job].pull()
    return local(job)


def optimizer_state(job: str) -> dict:
    return _models[job].optimizer_state_dict()


def load(job: str, state_dict: dict, optimizer_state_dict: dict | None = None, optimizer_first: bool = False) -> bool:
    ps = _models[job]
    if optimizer_first:  # torch's model and optimizer loads go in either order
        ps.load_optimizer_state_dict(optimizer_state_dict)
    ps.load_state_dict(state_dict)
    if optimizer_state_dict is not None and not optimizer_first:
        ps.load_optimizer_state_dict(optimizer_state_dict)
    return True


def stats(job: str) -> dict:
    return _models[job].stats()


def step_twice(job: str, trainer: int) -> dict:
    """A sync trainer pushing twice without pulling in between: the second push's outcome."""
    ps = _models[job]
    x, y = batch(trainer, 0)
    nn.functional.mse_loss(ps(x), y).backward()
    ps.step()
    nn.functional.mse_loss(ps.module(x), y).backward()  # the local model: no pull, no wait
    return _attempt(ps.step)


def forward_backward(job: str, trainer: int, step: int = 0) -> bool:
    """Gradients of one step in the local model (nothing pushed yet)."""
    ps = _models[job]
    x, y = batch(trainer, step)
    nn.functional.mse_loss(ps(x), y).backward()
    return True


def attempt(job: str, what: str) -> dict:
    """How ``pull`` / ``step`` / ``send`` of ``job`` ends here (type, message, seconds); a
    step returns with its pushes in flight (``send``): ``flush()`` lands them (a failure
    raises there)."""
    ps = _models[job]
    return _attempt({"pull": ps.pull, "step": lambda: (ps.step(), ps.flush()), "send": ps.step}[what])


def half_async_timed(job: str, c: list[float], seconds: float) -> dict:
    """half_async: push ``c`` once, pull at once (nothing merged yet), then poll ``stats()``
    until every server applied it (at most ``seconds``): when, measured from just before the
    push was made (no server can have queued it earlier, however slow this trainer is)."""
    ps = _models[job]
    ps(torch.tensor(c)).backward()
    pushed = time.monotonic()
    ps.step()
    before = pulled(job)["p"]
    queued_before = [st["queued"] for st in ps.stats().values()]
    checked_at = time.monotonic() - pushed
    merged_after = None
    while time.monotonic() < pushed + seconds:
        if all(st["applied"] == 1 and st["queued"] == 0 for st in ps.stats().values()):
            merged_after = time.monotonic() - pushed
            break
        time.sleep(0.02)
    return {"before": before, "queued_before": queued_before, "checked_at": checked_at, "merged_after": merged_after,
            "after": pulled(job)["p"]}




def train_then_state(job: str, trainer: int, steps: int) -> dict:
    """:func:`train`, then at once :func:`state` (a checkpoint right after the last push)."""
    train(job, trainer, steps)
    return state(job)


def later(seconds: float, fn, *args: Any) -> Any:
    """``fn(*args)`` after ``seconds`` (to push after another trainer, most likely)."""
    time.sleep(seconds)
    return fn(*args)


def set_timeout(job: str, seconds: float | None) -> bool:
    """The job's per-call timeout from now on (created without one: a loaded machine may take
    more than a short timeout to attach, and that is not what the fault tests test)."""
    _models[job].timeout = seconds
    return True


def in_threads(target: Callable[[], Any], count: int) -> None:
    """Run ``target`` in ``count`` threads at once and wait for them; the first exception one of
    them raised is raised here (reported to the test)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            target()
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=run) for _ in range(count)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]


_captured: dict[str, dict] = {}


def step_and_capture(job: str, trainer: int, step: int = 0) -> bool:
    """A training step, then (without taking them) the servers' values as a pull right after
    that push sees them, kept for :func:`forward_seen`."""
    ps = _models[job]
    x, y = batch(trainer, step)
    nn.functional.mse_loss(ps(x), y).backward()
    ps.step()
    ps._wait_pushes()  # (the step returns with its pushes in flight: landed, keeping their answers)
    _captured[job] = ps._server_values()
    return True


def forward_seen(job: str, trainer: int, checkpoint_first: bool = False) -> dict:
    """The next forward (after ``state_dict()`` with ``checkpoint_first``): the messages it sent
    per server, and whether its output is the model's at the values captured right after this
    trainer's last push, or at the servers' values now."""
    from torch.func import functional_call

    from tests.benchmarks._common import messages_per_call

    ps = _models[job]
    if checkpoint_first:
        ps.state_dict()
    now = ps._server_values()
    x, _ = batch(trainer, 99)
    got: dict = {}
    messages = messages_per_call(lambda: got.update(out=ps(x).detach()), 1)
    ps.zero_grad()

    def at(values: dict) -> torch.Tensor:
        with torch.no_grad():
            return functional_call(ps.module, ps._assembled(values), (x,))

    return {"messages": messages, "right_after_push": torch.equal(got["out"], at(_captured[job])),
            "servers_now": torch.equal(got["out"], at(now))}
