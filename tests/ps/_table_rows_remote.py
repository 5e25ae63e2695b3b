"""What tests/ps/test_table_rows.py runs on its trainers: tables with a padding row trained as
``nn.Embedding`` / ``nn.EmbeddingBag`` train theirs, tables' initial rows read back from the
servers, tables built from numpy integers. Each returns plain tensors and values to pytest,
which computes the torch references itself (the same functions with ``local=True``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

SERVERS = ["ps0", "ps1"]
ROWS, DIM, PAD = 200, 4, 137  # the padding row sits in the second block (rows 100..199)


def start_weight() -> torch.Tensor:
    """The rows both sides start from: random, with a padding row that is not zero (a
    checkpoint may hold any padding row; nn.Embedding loads it and returns it as stored)."""
    w = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(11))
    w[PAD] = torch.tensor([1.5, -2.0, 3.0, 0.25])
    return w


def embedding_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(2-D ids with the padding id in them, target) per step."""
    g = torch.Generator().manual_seed(12)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, ROWS, (3, 5), generator=g)
        ids[0, 1] = ids[2, 4] = PAD
        out.append((ids, torch.randn(3, 5, DIM, generator=g)))
    return out


def bag_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(1-D ids, offsets, target) per step: 4 bags, the first with the padding id among others,
    the third of padding ids only, the last empty."""
    g = torch.Generator().manual_seed(13)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, ROWS, (12,), generator=g)
        ids[1] = ids[6] = ids[7] = PAD
        out.append((ids, torch.tensor([0, 4, 6, 12]), torch.randn(4, DIM, generator=g)))
    return out


def padded_run(name: str | None, kind: str, init: str, ps_mode: str, optimizer: tuple, steps: int = 3) -> dict:
    """A table with ``padding_idx=PAD`` (``kind``: ``"emb"`` or a bag mode) loaded with
    start_weight(), trained ``steps`` steps; with ``name=None`` the local torch module and
    optimizer instead. Its rows when fresh (sharded only), every output, the final rows and
    the ids that have optimizer state."""
    from remote_module.ps import ShardedEmbedding, ShardedEmbeddingBag

    cls, kwargs = optimizer
    out: dict[str, Any] = {}
    if name is None:
        sparse = kind != "max"  # torch cannot make a max bag sparse: its dense step is the reference
        if kind == "emb":
            module = nn.Embedding(ROWS, DIM, padding_idx=PAD, sparse=sparse)
        else:
            module = nn.EmbeddingBag(ROWS, DIM, mode=kind, padding_idx=PAD, sparse=sparse)
        out["fresh_pad"] = module.weight.detach()[PAD].clone()
        module.load_state_dict({"weight": start_weight()})
        opt = cls(module.parameters(), **kwargs)
        step, zero_grad = opt.step, opt.zero_grad
    else:
        common = dict(padding_idx=PAD, init=init, ps_mode=ps_mode, optimizer=optimizer, min_block_size=ROWS * DIM // 2,
                      geo_push_every=1, half_async_merge_every=1)
        if kind == "emb":
            module = ShardedEmbedding(ROWS, DIM, SERVERS, name=name, **common)
        else:
            module = ShardedEmbeddingBag(ROWS, DIM, SERVERS, name=name, mode=kind, **common)
        if kind == "emb":
            with torch.no_grad():
                out["fresh_pad"] = module(torch.tensor([PAD]))[0]
        out["fresh_rows"] = rows_of(module)
        module.load_state_dict(state_of(module, start_weight()))
        step, zero_grad = module.step, module.zero_grad
    outs = []
    batches = embedding_batches(steps) if kind == "emb" else bag_batches(steps)
    for ids, *args, target in batches:
        zero_grad()
        got = module(ids, *args)
        outs.append(got.detach())
        ((got - target) ** 2).sum().backward()
        step()
    out["outs"] = outs
    if name is None:
        out["rows"] = module.weight.detach()
        state = opt.state_dict()["state"]
        out["stepped"] = None if not state else _stepped_local(state[0], kind)
    else:
        out["rows"] = rows_of(module)
        if ps_mode == "geo":  # the optimizer state of geo tables lives on the trainer
            out["stepped"] = module._geo.state_ids.tolist() if module._geo.state else None
        else:
            got_state = module.optimizer_state_dict()
            out["stepped"] = got_state["ids"].tolist() if len(got_state) > 2 else None
    return out


def _stepped_local(state: dict, kind: str) -> list[int] | None:
    """The rows whose optimizer state a local torch optimizer changed from its initial value."""
    if "sum" in state:  # Adagrad: rows whose sum of squares grew
        init = state["sum"].min()
        return (state["sum"] != init).any(dim=1).nonzero().reshape(-1).tolist()
    return None


def rows_of(module: nn.Module) -> torch.Tensor:
    """All ROWS rows of a sharded table, as its state_dict() saves them (a lazy one saves the
    rows it stores; the others are read from the servers, which creates none)."""
    state = module.state_dict()
    if "weight" in state:
        return state["weight"]
    rows = server_rows(module, torch.arange(ROWS))
    rows[state["weight.ids"]] = state["weight.rows"]
    return rows


def state_of(module: nn.Module, weight: torch.Tensor) -> dict:
    """``weight`` as the state_dict ``module`` (eager or lazy) loads."""
    if module.init == "lazy":
        return {"weight.ids": torch.arange(weight.shape[0]), "weight.rows": weight}
    return {"weight": weight}


def server_rows(module: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a sharded table as its servers hold them (past any trainer-side cache)."""
    from remote_module._core.fanout import call_all
    from remote_module.ps.tables.server import _handlers

    parts = [(server, mine) for _, server, mine in module._by_server_of(ids)]
    got = call_all([(server, _handlers._rows_for, (module.name, ids[mine], module._step))
                    for server, mine in parts])
    out = torch.empty(ids.numel(), module.embedding_dim)
    for (_, mine), rows in zip(parts, got):
        out[mine] = rows
    return out


def initial_rows_on_servers(name: str, init: str, seed: int, rows: int, dim: int, ids: list[int],
                            servers: list[str], min_block_size: int, padding_idx: int | None = None) -> torch.Tensor:
    """A fresh table's rows ``ids``, read from its servers (no lookup creates a lazy row)."""
    from remote_module.ps import ShardedEmbedding

    t = ShardedEmbedding(rows, dim, servers, name=name, init=init, seed=seed, min_block_size=min_block_size,
                         padding_idx=padding_idx)
    with torch.no_grad():
        return t(torch.tensor(ids))


def numpy_sized(name: str | None) -> dict:
    """A mean bag and an embedding built with numpy integers for every integer argument (as
    facebookresearch/dlrm passes its sizes), loaded with start_weight(); with ``name=None``
    local torch modules built from the same numpy integers. Their outputs and attributes."""
    import numpy as np

    rows, dim, pad = np.int64(ROWS), np.int32(DIM), np.int64(PAD)
    if name is None:
        bag = nn.EmbeddingBag(rows, dim, mode="mean", padding_idx=pad)
        emb = nn.Embedding(rows, dim, padding_idx=pad)
    else:
        from remote_module.ps import ShardedEmbedding, ShardedEmbeddingBag

        sizes = dict(padding_idx=pad, min_block_size=np.int64(ROWS * DIM // 2), num_trainers=np.int32(1),
                     seed=np.uint8(3), geo_push_every=np.int64(2), half_async_merge_every=np.int16(2))
        bag = ShardedEmbeddingBag(rows, dim, SERVERS, name=name + "-bag", mode="mean", **sizes)
        emb = ShardedEmbedding(rows, dim, SERVERS, name=name + "-emb", **sizes)
    for module in (bag, emb):
        module.load_state_dict({"weight": start_weight()})
    ids, offsets, _ = bag_batches(1)[0]
    with torch.no_grad():
        outs = {"bag": bag(ids, offsets), "emb": emb(ids)}
    attrs = {k: (type(getattr(emb, k)).__name__, int(getattr(emb, k)))
             for k in ("num_embeddings", "embedding_dim", "padding_idx")}
    return {"outs": outs, "attrs": attrs}


def psmodel_numpy_sized(name: str) -> dict:
    """A PSModel built with numpy integers (validated as ShardedEmbedding validates them): the
    types its integer attributes are kept as."""
    import numpy as np

    from remote_module.ps import PSModel

    ps = PSModel(nn.Linear(2, 2), SERVERS, name=name, num_trainers=np.int32(1), ps_mode="geo",
                 geo_push_every=np.int64(2), half_async_merge_every=np.int16(2))
    return {k: type(getattr(ps, k)).__name__ for k in ("num_trainers", "geo_push_every")}


def attach_with_other_padding(name: str) -> dict:
    """A table created with padding_idx=3, then attached by an object asking for padding_idx=4,
    and one asking for none: the refusals' types and messages."""
    from remote_module.ps import ShardedEmbedding

    ShardedEmbedding(20, 3, SERVERS, name=name, padding_idx=3, min_block_size=1)
    out = {}
    for other in (4, None):
        try:
            ShardedEmbedding(20, 3, SERVERS, name=name, padding_idx=other, min_block_size=1)
            out[other] = None
        except Exception as exc:  # noqa: BLE001 - returned to the test
            out[other] = (type(exc).__name__, str(exc))
    return out
