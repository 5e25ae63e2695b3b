"""A DLRM-style model for bench_dlrm, after facebookresearch/dlrm's ``DLRM_Net``
(``dlrm_s_pytorch.py``): a bottom MLP on the dense features, one sum-pooled embedding bag
per sparse feature, the "dot" interaction without self-pairs (the bottom MLP's output, then
the strictly lower triangle of ``T T^T`` for ``T = [x, bag_1, ..., bag_k]``), a top MLP ending
in a sigmoid, MSE loss. Weights initialised as dlrm does (numpy normal for the MLPs, uniform
``+-sqrt(1/rows)`` for the tables), data as its random generator makes it (1 to 10 unique ids
per bag). Written for this benchmark; the shapes and the interaction are dlrm's.

Three ways to hold the tables, the rest of the model the same:

- ``local``: ``nn.EmbeddingBag(mode="sum", sparse=True)``s, stepped by the model's optimizer;
- ``collection``: ``ShardedEmbeddingBag``s in one ``ShardedEmbeddingBagCollection`` (one
  message per server for a lookup, one for a push);
- ``tables``: the same sharded tables called and stepped one by one;
- ``collection prefetch``: the collection fed through ``remote_module.ps.prefetching`` (a
  step sends the next batch's lookups with its pushes, answered once they are applied);
- ``collection prefetch overlap``: ``prefetching(..., overlap=True)`` (async only): a step
  sends the lookups of the batch after the next, so their round trip overlaps the next
  batch's compute; each lookup misses exactly this trainer's last push before its forward.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np
import torch
from torch import nn

from remote_module.ps import ShardedEmbeddingBag, ShardedEmbeddingBagCollection, prefetching

VARIANTS = ("local", "collection", "tables", "collection prefetch", "collection prefetch overlap")
SYNC_VARIANTS = VARIANTS[:4]  # (overlap is for async tables)


def interaction_width(num_tables: int, dim: int) -> int:
    features = num_tables + 1
    return features * (features - 1) // 2 + dim


def batches(cfg: dict, n: int, seed: int) -> list[tuple]:
    """``n`` batches ``(dense, offsets per table, ids per table, target)``."""
    gen = np.random.RandomState(seed)
    out = []
    for _ in range(n):
        dense = torch.tensor(gen.rand(cfg["batch"], cfg["bottom"][0]).astype(np.float32))
        offsets, ids = [], []
        for rows in cfg["tables"]:
            starts, chosen, at = [], [], 0
            for _ in range(cfg["batch"]):
                k = int(np.round(max(1.0, gen.random() * min(rows, cfg["ids_per_bag"]))))
                bag = np.unique(np.round(gen.random(k) * (rows - 1)).astype(np.int64))
                starts.append(at)
                chosen.extend(bag.tolist())
                at += bag.size
            offsets.append(torch.tensor(starts))
            ids.append(torch.tensor(chosen))
        target = torch.tensor(gen.rand(cfg["batch"], 1).astype(np.float32))
        out.append((dense, offsets, ids, target))
    return out


def _mlp(widths: list[int], sigmoid_at: int, gen: np.random.RandomState) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(widths) - 1):
        n, m = widths[i], widths[i + 1]
        linear = nn.Linear(n, m)
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(gen.normal(0.0, np.sqrt(2 / (m + n)), (m, n)).astype(np.float32)))
            linear.bias.copy_(torch.from_numpy(gen.normal(0.0, np.sqrt(1 / m), m).astype(np.float32)))
        layers += [linear, nn.Sigmoid() if i == sigmoid_at else nn.ReLU()]
    return nn.Sequential(*layers)


def initial_rows(cfg: dict, seed: int) -> list[torch.Tensor]:
    gen = np.random.RandomState(seed + 1)
    return [torch.from_numpy(gen.uniform(-np.sqrt(1 / n), np.sqrt(1 / n), (n, cfg["dim"])).astype(np.float32))
            for n in cfg["tables"]]


class Tables(nn.Module):
    """The pooled bags of every table, held one of :data:`VARIANTS`' ways."""

    def __init__(self, cfg: dict, variant: str, servers: list[str], name: str, ps_mode: str, seed: int) -> None:
        super().__init__()
        self.variant = variant
        rows = initial_rows(cfg, seed)
        if variant == "local":
            self.bags = nn.ModuleList(nn.EmbeddingBag(w.shape[0], cfg["dim"], mode="sum", sparse=True) for w in rows)
        else:
            self.bags = nn.ModuleList(
                ShardedEmbeddingBag(w.shape[0], cfg["dim"], servers, name=f"{name}.t{k}", mode="sum", ps_mode=ps_mode,
                                    optimizer=(torch.optim.SGD, {"lr": cfg["lr"]}))
                for k, w in enumerate(rows)
            )
        for bag, w in zip(self.bags, rows):
            bag.load_state_dict({"weight": w})
        if variant.startswith("collection"):
            # the same table objects, grouped: the collection sends their calls
            self.collection = ShardedEmbeddingBagCollection({f"t{k}": bag for k, bag in enumerate(self.bags)})

    def forward(self, offsets: list[torch.Tensor], ids: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.variant.startswith("collection"):
            out = self.collection({f"t{k}": (i, o) for k, (i, o) in enumerate(zip(ids, offsets))})
            return [out[f"t{k}"] for k in range(len(ids))]
        return [bag(i, o) for bag, i, o in zip(self.bags, ids, offsets)]

    def flush(self) -> None:
        """Wait for the pushes in flight (nothing to wait for with local tables)."""
        self._on_ps_tables("flush")

    def step(self) -> None:
        self._on_ps_tables("step")

    def _on_ps_tables(self, method: str) -> None:
        """``method()`` on the collection, or on each parameter-server table (local ones: none)."""
        if self.variant.startswith("collection"):
            getattr(self.collection, method)()
        elif self.variant == "tables":
            for bag in self.bags:
                getattr(bag, method)()


class DLRM(nn.Module):
    def __init__(self, cfg: dict, tables: Tables, seed: int) -> None:
        super().__init__()
        gen = np.random.RandomState(seed)
        self.bottom = _mlp(cfg["bottom"], -1, gen)
        top = [interaction_width(len(cfg["tables"]), cfg["dim"])] + cfg["top"]
        self.top = _mlp(top, len(top) - 2, gen)
        self.tables = tables
        n = len(cfg["tables"]) + 1
        self.register_buffer("pairs", torch.tril_indices(n, n, offset=-1), persistent=False)

    def forward(self, dense: torch.Tensor, offsets: list[torch.Tensor], ids: list[torch.Tensor]) -> torch.Tensor:
        x = self.bottom(dense)
        stacked = torch.stack([x, *self.tables(offsets, ids)], dim=1)
        products = torch.bmm(stacked, stacked.transpose(1, 2))
        return self.top(torch.cat([x, products[:, self.pairs[0], self.pairs[1]]], dim=1))


def build(cfg: dict, variant: str, servers: list[str], name: str, ps_mode: str, seed: int
          ) -> tuple[DLRM, torch.optim.Optimizer]:
    """The model and, as dlrm, one SGD over all its parameters (the sharded tables' rows step
    on the servers through ``tables.step()``)."""
    model = DLRM(cfg, Tables(cfg, variant, servers, name, ps_mode, seed), seed)
    return model, torch.optim.SGD(model.parameters(), lr=cfg["lr"])


def features(batch: tuple) -> dict[str, tuple]:
    """A batch's input of the collection (``prefetching(batches, collection, features=features)``)."""
    _, offsets, ids, _ = batch
    return {f"t{k}": (i, o) for k, (i, o) in enumerate(zip(ids, offsets))}


def feed(model: DLRM, batches: Iterable) -> Iterator:
    """``batches`` as a variant trains them: the "collection prefetch" variants through
    ``remote_module.ps.prefetching`` (a step sends the next batch's lookups with its pushes;
    with ``overlap=True``, those of the batch after the next)."""
    variant = model.tables.variant
    if not variant.startswith("collection prefetch"):
        return iter(batches)
    return prefetching(batches, model.tables.collection, features=features, overlap=variant.endswith("overlap"))


def train_step(model: DLRM, opt: torch.optim.Optimizer, batch: tuple) -> float:
    dense, offsets, ids, target = batch
    loss = nn.functional.mse_loss(model(dense, offsets, ids), target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    model.tables.step()
    return loss.item()
