"""What tests/ps/test_in_flight_edges.py runs on its trainers (a step in flight: copies,
threads, a stalled sync step retried, a geo table's push that fails on one server)."""

from __future__ import annotations

import copy
import pickle
import threading
from typing import Any

import torch
from torch import nn

from tests.ps import _dense_remote as r

_tables: dict[str, Any] = {}


def step_then_copy(job: str, trainer: int) -> dict:
    """A step (its pushes in flight), then ``copy.deepcopy`` and a pickle round trip of the
    PSModel: whether each worked, and their parameters."""
    ps = r._models[job]
    x, y = r.batch(trainer, 0)
    nn.functional.mse_loss(ps(x), y).backward()
    ps.step()
    out = {}
    for what, make in (("deepcopy", lambda: copy.deepcopy(ps)), ("pickle", lambda: pickle.loads(pickle.dumps(ps)))):
        try:
            made = make()
            out[what] = {k: v.detach().clone() for k, v in made.module.state_dict().items()}
        except Exception as exc:
            out[what] = f"{type(exc).__name__}: {exc}"
    return out


def step_then_threads_forward(job: str, trainer: int, threads: int = 2) -> list[torch.Tensor]:
    """A step (its pushes in flight), then ``threads`` threads calling the model's forward at
    once (under no_grad) on the same input: their outputs."""
    ps = r._models[job]
    x, y = r.batch(trainer, 0)
    nn.functional.mse_loss(ps(x), y).backward()
    ps.step()
    probe = torch.ones(1, r.IN)
    outs: list[Any] = [None] * threads
    barrier = threading.Barrier(threads)

    def run(k: int) -> None:
        barrier.wait()
        with torch.no_grad():
            outs[k] = ps(probe).clone()

    workers = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return outs


def geo_bag(name: str, weights: torch.Tensor, timeout: float) -> list:
    """A geo ShardedEmbeddingBag (sum) over ps0 and ps1 (min_block_size=1), num_trainers=1,
    pushing every step, loaded with ``weights``, its calls timing out after ``timeout``; its
    row ranges."""
    from remote_module.ps import ShardedEmbeddingBag

    bag = ShardedEmbeddingBag(weights.shape[0], weights.shape[1], ["ps0", "ps1"], name=name, mode="sum",
                              ps_mode="geo", num_trainers=1, geo_push_every=1, min_block_size=1,
                              optimizer=(torch.optim.SGD, {"lr": 0.1}), timeout=timeout)
    bag.load_state_dict({"weight": weights})
    _tables[name] = bag
    return bag._ranges


def geo_bag_timeout(name: str, seconds: float) -> bool:
    """The timeout of :func:`geo_bag`'s calls from now on."""
    _tables[name].timeout = seconds
    return True


def geo_bag_backward(name: str, ids: list[int]) -> bool:
    """A forward of one bag of ``ids`` and its backward."""
    _tables[name](torch.tensor([ids])).pow(2).sum().backward()
    return True


def geo_bag_step(name: str) -> dict:
    """step() (its push in flight), then flush(): how the flush ended."""
    bag = _tables[name]
    bag.step()
    return r._attempt(bag.flush)


def geo_bag_local_row(name: str, row: int) -> torch.Tensor | None:
    """The trainer's cached (locally trained) value of ``row``, None if not cached."""
    geo = _tables[name]._geo
    hit = (geo.ids == row).nonzero()
    return geo.rows[int(hit[0, 0])].clone() if hit.numel() else None


def server_rows(name: str, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(on a server) the ids and rows of the block of table ``name`` starting at ``first``."""
    from remote_module.ps.tables.server import _checkpoint_handlers

    return _checkpoint_handlers._block_rows(name, first)


def counted(job: str, trainer: str) -> tuple | None:
    """(On a server) ``trainer``'s last sync push of dense job ``job`` that counted there:
    ``(step, token)``, or None."""
    from remote_module.ps.dense import _server as _dense_server

    held = _dense_server._job(job)
    with held.lock:
        return held.sync.last_push.get(trainer)


def has_gradients(job: str) -> bool:
    """Whether the PSModel of ``job`` holds local gradients (a failed push puts them back)."""
    return any(p.grad is not None for p in r._models[job]._params().values())
