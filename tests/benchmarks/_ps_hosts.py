"""The parameter-server benchmark's model, data and trainer-side variants.

* the model and batch of ``tutorials/parameter_server.py``: ``Linear(784, 128) + ReLU +
  Linear(128, 10)``, batch 64, cross-entropy, SGD;
* ``PSModel`` in each mode with 1 or 2 servers (one job per variant, by name);
* PyTorch's RPC parameter-server tutorial pattern, written here by hand: one server holds the
  whole model (created once and shared through an RRef); each trainer sends its batch to the
  server's forward by RPC with the RRef, runs ``dist_autograd.backward`` on the returned output,
  and a ``DistributedOptimizer`` over the server's parameter RRefs applies SGD on the server
  (async: each trainer's step as it comes). The model sits behind one lock that a trainer holds
  for its whole step (forward, backward, optimizer step): without it, two trainers crash the
  pattern (one trainer's optimizer step modifies in place a weight that the other's backward
  still needs; "modified by an inplace operation", pytorch/tutorials#2095,
  pytorch/examples#877), and a whole-step lock is the fix its authors proposed
  (pytorch/examples#842).

A trainer holds its variants in ``_trainer``; the driver calls :func:`setup` once per variant
on every trainer and then :func:`run_steps` on all trainers at once. Functions called over RPC
are module level (RPC pickles them by reference).
"""

from __future__ import annotations

import threading
import warnings

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.optim import DistributedOptimizer

IN, HIDDEN, CLASSES = 784, 128, 10
TUTORIAL = "tutorial pattern"

# ---- model and data ---------------------------------------------------------------------


def build_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


def make_batch(cfg: dict, trainer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed batch per trainer (class prototypes plus noise, as in the tutorial)."""
    prototypes = torch.rand(CLASSES, IN, generator=torch.Generator().manual_seed(42))
    gen = torch.Generator().manual_seed(1000 + trainer)
    y = torch.randint(0, CLASSES, (cfg["batch"],), generator=gen)
    return prototypes[y] + torch.randn(cfg["batch"], IN, generator=gen), y


def handler_threads() -> int:
    """``torch.get_num_threads()`` as an RPC handler thread of this process sees it."""
    return torch.get_num_threads()


# ---- the tutorial pattern: the server side ---------------------------------------------------

_server: dict = {}
_server_lock = threading.Lock()


class TutorialServer(nn.Module):
    """The whole model on one server, behind one lock (held by a trainer for its whole step)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = build_model()
        self.lock = threading.Lock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


def tutorial_server() -> TutorialServer:
    """On the server: the one shared instance, created by the first trainer that asks."""
    with _server_lock:
        if "model" not in _server:
            _server["model"] = TutorialServer()
        return _server["model"]


def _tutorial_forward(server: rpc.RRef, x: torch.Tensor) -> torch.Tensor:
    return server.local_value()(x)


def _tutorial_lock(server: rpc.RRef) -> None:
    if not server.local_value().lock.acquire(timeout=60):
        raise TimeoutError("the tutorial server's lock was not released within 60 s")


def _tutorial_unlock(server: rpc.RRef) -> None:
    server.local_value().lock.release()


def _tutorial_param_rrefs(server: rpc.RRef) -> list[rpc.RRef]:
    return [rpc.RRef(p) for p in server.local_value().parameters()]


def tutorial_parameters() -> list[torch.Tensor]:
    """On the server: the current parameters (for the driver's checks)."""
    return [p.detach().clone() for p in _server["model"].parameters()]


class _TutorialTrainer:
    def __init__(self, server: str, lr: float) -> None:
        self.server = rpc.remote(server, tutorial_server)
        params = rpc.rpc_sync(server, _tutorial_param_rrefs, (self.server,))
        with warnings.catch_warnings():  # torch 2.13 warns that its TorchScript functional optimizers are deprecated
            warnings.simplefilter("ignore", DeprecationWarning)
            self.opt = DistributedOptimizer(torch.optim.SGD, params, lr=lr)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        owner = self.server.owner()
        rpc.rpc_sync(owner, _tutorial_lock, (self.server,))
        try:
            with dist_autograd.context() as ctx:
                out = rpc.rpc_sync(owner, _tutorial_forward, (self.server, x))
                loss = nn.functional.cross_entropy(out, y)
                dist_autograd.backward(ctx, [loss])
                self.opt.step(ctx)
        finally:
            rpc.rpc_sync(owner, _tutorial_unlock, (self.server,))
        return loss.item()


# ---- PSModel -------------------------------------------------------------------------------


class _PSTrainer:
    def __init__(self, cfg: dict, mode: str, servers: list[str], num_trainers: int) -> None:
        from remote_module.ps import PSModel

        self.model = PSModel(
            build_model(), servers, name=f"bench-{mode}-{len(servers)}", num_trainers=num_trainers, ps_mode=mode,
            optimizer=(torch.optim.SGD, {"lr": cfg["lr"]}), geo_push_every=cfg["geo_push_every"],
            half_async_merge_every=cfg["half_async_merge_every"], timeout=60,
        )

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        self.model.step()
        return loss.item()


# ---- on a trainer --------------------------------------------------------------------------

_trainer: dict = {}


def variant_name(mode: str, servers: int) -> str:
    return f"{mode} servers={servers}"


def setup(cfg: dict, trainer: int, num_trainers: int, variant: str, servers: list[str]) -> None:
    """Build ``variant`` on this trainer (``TUTORIAL`` or a :func:`variant_name`)."""
    _trainer.setdefault("batch", make_batch(cfg, trainer))
    if variant == TUTORIAL:
        _trainer[variant] = _TutorialTrainer(servers[0], cfg["lr"])
    else:
        _trainer[variant] = _PSTrainer(cfg, variant.split()[0], servers, num_trainers)


def run_steps(variant: str, steps: int) -> float:
    """``steps`` training steps of ``variant`` on this trainer's batch; the last loss."""
    x, y = _trainer["batch"]
    model = _trainer[variant]
    loss = float("nan")
    for _ in range(steps):
        loss = model.step(x, y)
    return loss


def flush(variant: str) -> None:
    """The end of ``variant``'s training on this trainer (a PSModel's ``flush()``: geo pushes
    the local steps since its last push, which it warns of when left unpushed)."""
    if variant != TUTORIAL:
        _trainer[variant].model.flush()


def ps_stats(variant: str) -> dict:
    return _trainer[variant].model.stats()
