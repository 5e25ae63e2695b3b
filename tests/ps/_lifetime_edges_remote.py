"""What tests/ps/test_table_lifetime_edges.py runs on its trainers: eager tables with eviction,
admission sketches loaded onto other layouts and widths, and loads in either order."""

from __future__ import annotations

import torch


def table(name: str, servers: list[str], **kwargs):
    from remote_module.ps import ShardedEmbedding

    kwargs = {"optimizer": (torch.optim.SGD, {"lr": 0.5}), "min_block_size": 2, **kwargs}
    return ShardedEmbedding(100, 2, servers, name=name, **kwargs)


def step(emb, ids: list[int]) -> None:
    emb(torch.tensor(ids)).sum().backward()
    emb.step()


def eager_eviction(name: str) -> dict:
    """An eager table (evict_after_steps=4) whose steps touch rows 1, 2 and 50 only, row 7
    once at the start: its stats, and the delta of 8 steps after a baseline."""
    emb = table(name, ["ps0", "ps1"], evict_after_steps=4)
    step(emb, [7])
    for _ in range(12):
        step(emb, [1, 2, 50])
    stats = emb.table_stats()
    emb.delta_state_dict("t")  # (the baseline)
    for _ in range(8):
        step(emb, [1, 2, 50])
    delta = emb.delta_state_dict("t")
    with torch.no_grad():
        rows = emb(torch.arange(100))
    return {"evicted": stats["rows_evicted"], "delta_ids": delta["ids"].tolist(),
            "delta_evicted": delta["evicted"].tolist(), "rows": rows}


def sketch_onto_another_layout(name: str) -> dict:
    """A checkpoint of a table on ps0 that never saw id 7, loaded into one on ps1, ps2 that
    counted it once: a step of 7 on both admits it in neither (admit_after=2)."""
    kwargs = {"init": "lazy", "admit_after": 2, "admit_sketch_bytes": 4096}
    saved = table(name, ["ps0"], **kwargs)
    loader = table(name, ["ps1", "ps2"], **kwargs)
    step(saved, [1])
    step(loader, [7])
    loader.load_state_dict(saved.state_dict())
    step(saved, [7])
    step(loader, [7])
    return {"saved": saved.table_stats()["rows_held"], "loader": loader.table_stats()["rows_held"]}


def sketch_of_another_width(name: str) -> dict:
    """A checkpoint and a delta of a table with admit_after=2 (2-bit counters) loaded into one
    with admit_after=5 (4-bit): the errors (or "no error")."""
    saved = table(name, ["ps0"], init="lazy", admit_after=2, admit_sketch_bytes=64)
    for s in range(3):
        step(saved, list(range(10 + s * 20, 30 + s * 20)))
    loader = table(name + "-5", ["ps1"], init="lazy", admit_after=5, admit_sketch_bytes=64)
    out = {}
    for what, load in (("state_dict", lambda: loader.load_state_dict(saved.state_dict())),
                       ("delta", lambda: loader.load_delta_state_dict(saved.delta_state_dict("t")))):
        try:
            load()
            out[what] = "no error"
        except (RuntimeError, ValueError) as exc:
            out[what] = f"{type(exc).__name__}: {exc}"
    out["held"] = loader.table_stats()["rows_held"]
    return out


def optimizer_state_loaded_first(name: str, optimizer_first: bool) -> dict:
    """A lazy Adagrad table with eviction trained 7 steps on ps0, its checkpoint loaded into a
    table on ps1 (the optimizer state first or last): both tables' optimizer state."""
    kwargs = {"init": "lazy", "evict_after_steps": 3, "optimizer": (torch.optim.Adagrad, {"lr": 0.3})}
    saved = table(name, ["ps0"], **kwargs)
    for s in range(7):
        step(saved, [s, 50 + s % 2])
    model, optim = saved.state_dict(), saved.optimizer_state_dict()
    loader = table(name, ["ps1"], **kwargs)
    if optimizer_first:
        loader.load_optimizer_state_dict(optim)
        loader.load_state_dict(model)
    else:
        loader.load_state_dict(model)
        loader.load_optimizer_state_dict(optim)
    return {"saved": optim, "loaded": loader.optimizer_state_dict()}
