"""The embedding benchmark's batches, loss and variants (importable on every worker).

* batches of a click model: ``bags`` bags of ``ids_per_bag`` ids each, drawn uniformly from the
  table (a fixed cycle of ``num_batches`` batches, seeded), and a fixed regression target per
  batch;
* the loss: ``((out - target) ** 2).sum() / dim`` (the gradient depends on the rows looked up,
  so two variants that train differently drift apart at once);
* :class:`Anchor`: PyTorch's hybrid-model example pattern, one
  ``torch.distributed.nn.RemoteModule(nn.EmbeddingBag)`` on one server, trained under
  ``torch.distributed.autograd`` with a ``DistributedOptimizer``;
* :class:`Sharded`: ``remote_module.ps.ShardedEmbeddingBag`` over 1 or 2 servers.

Every variant offers ``train(batch)`` (forward, loss, backward, optimizer step), ``lookup(batch)``
(a forward under ``no_grad``), ``weight()`` (the whole table, for the equality checks) and
``load(weight)``. Functions called over RPC are module level (RPC pickles them by reference).
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # ids (flat), offsets, target


def make_batches(cfg: dict) -> list[Batch]:
    """``num_batches`` click-model batches: flat ids, bag offsets, a target of ``bags x dim``."""
    gen = torch.Generator().manual_seed(cfg["seed"])
    bags, per_bag = cfg["bags"], cfg["ids_per_bag"]
    out = []
    for _ in range(cfg["num_batches"]):
        ids = torch.randint(0, cfg["rows"], (bags * per_bag,), generator=gen)
        offsets = torch.arange(0, bags * per_bag, per_bag)
        out.append((ids, offsets, torch.randn(bags, cfg["dim"], generator=gen)))
    return out


def loss_of(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).sum() / out.shape[1]


def handler_threads() -> int:
    """``torch.get_num_threads()`` as an RPC handler thread of this process sees it."""
    return torch.get_num_threads()


def echo(x: torch.Tensor) -> torch.Tensor:
    """The empty call of the floor (bench_embedding): its argument back."""
    return x


def round_trips(servers: list[str], payload: torch.Tensor) -> None:
    """One Python call to each of ``servers`` at once, doing nothing: what one message per
    server per step costs by itself over torch.distributed.rpc."""
    torch.futures.wait_all([rpc.rpc_async(s, echo, args=(payload,)) for s in servers])


# ---- the anchor: PyTorch's hybrid-model example pattern ---------------------------------------


def _get_weight(module_rref: rpc.RRef) -> torch.Tensor:
    return module_rref.local_value().weight.detach().clone()


def _set_weight(module_rref: rpc.RRef, weight: torch.Tensor) -> None:
    with torch.no_grad():
        module_rref.local_value().weight.copy_(weight)


class Anchor:
    """One ``RemoteModule(nn.EmbeddingBag)`` holding the whole table on ``server``; a step is
    ``dist_autograd.context`` + ``dist_autograd.backward`` + ``DistributedOptimizer.step``."""

    def __init__(self, cfg: dict, server: str, sparse: bool) -> None:
        self.module = RemoteModule(
            f"{server}/cpu", nn.EmbeddingBag, args=(cfg["rows"], cfg["dim"]),
            kwargs={"mode": "sum", "sparse": sparse},
        )
        # (torch 2.13 prints, on the server, that its TorchScript functional optimizers are
        # deprecated; it forces that warning on, so it cannot be filtered)
        self.opt = DistributedOptimizer(torch.optim.SGD, self.module.remote_parameters(), lr=cfg["lr"])

    def train(self, batch: Batch) -> float:
        ids, offsets, target = batch
        with dist_autograd.context() as ctx:
            loss = loss_of(self.module.forward(ids, offsets), target)
            dist_autograd.backward(ctx, [loss])
            self.opt.step(ctx)
        return loss.item()

    def lookup(self, batch: Batch) -> torch.Tensor:
        with torch.no_grad():
            return self.module.forward(batch[0], batch[1])

    def weight(self) -> torch.Tensor:
        rref = self.module.module_rref
        return rpc.rpc_sync(rref.owner(), _get_weight, (rref,))

    def load(self, weight: torch.Tensor) -> None:
        rref = self.module.module_rref
        rpc.rpc_sync(rref.owner(), _set_weight, (rref, weight))


# ---- ShardedEmbeddingBag ------------------------------------------------------------------------


class Sharded:
    """``ShardedEmbeddingBag`` (async mode) over ``servers``; a step is ``loss.backward()`` +
    ``bag.step()`` (which returns with its pushes in flight). With ``prefetch``, the steps run
    through ``remote_module.ps.prefetching`` over the cycle of ``batches``, so a step sends the
    next batch's lookup with its pushes (one message per server per step)."""

    def __init__(self, cfg: dict, servers: list[str], prefetch: bool = False, batches: list | None = None,
                 overlap: bool = False) -> None:
        from remote_module.ps import ShardedEmbeddingBag

        self.prefetch, self.batches, self.feed, self.next, self.overlap = prefetch, batches, None, None, overlap
        self.index: dict[int, int] = {}  # id(batch) -> its index in batches (found without a scan every step)
        self.bag = ShardedEmbeddingBag(
            cfg["rows"], cfg["dim"], servers,
            name=f"bench-embedding-{len(servers)}{'-prefetch' * prefetch}{'-overlap' * overlap}",
            mode="sum", ps_mode="async", optimizer=(torch.optim.SGD, {"lr": cfg["lr"]}), seed=cfg["seed"], timeout=120,
        )

    def train(self, batch: Batch, upcoming: Batch | None = None, plain: bool = False) -> float:
        """One step on ``batch`` (``plain``: without prefetch, as the checks train)."""
        ids, offsets, target = batch
        if self.prefetch and self.batches is not None and not plain:
            # prefetching() over the batch cycle from this batch on (a new one where the caller
            # jumped elsewhere in the cycle): the next batches' lookups go with the steps
            at = self.index.get(id(batch))
            if at is None or self.batches[at] is not batch:
                self.index = {id(b): i for i, b in enumerate(self.batches)}
                at = self.index[id(batch)]
            if self.next != at:
                from remote_module.ps import prefetching

                if self.feed is not None:
                    self.feed.close()
                cycle = (self.batches[(at + j) % len(self.batches)] for j in itertools.count())
                self.feed = prefetching(cycle, self.bag, features=lambda b: (b[0], b[1]), overlap=self.overlap)
            got = next(self.feed)
            assert got is batch
            self.next = (at + 1) % len(self.batches)
        out = self.bag(ids, offsets)
        loss = loss_of(out, target)
        loss.backward()
        self.bag.step()
        return loss.item()

    def lookup(self, batch: Batch) -> torch.Tensor:
        with torch.no_grad():
            return self.bag(batch[0], batch[1])

    def weight(self) -> torch.Tensor:
        return self.bag.state_dict()["weight"]

    def load(self, weight: torch.Tensor) -> None:
        self.bag.load_state_dict({"weight": weight})
