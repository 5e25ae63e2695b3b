"""What the long-lived-table tests run on their trainers (tests/ps/test_table_lifetime.py):
lazy tables with row admission and eviction, trained on batches pytest rebuilds, and their
full and delta checkpoints."""

from __future__ import annotations

import torch

ROWS, DIM, LR = 4096, 4, 0.5


def batch(step: int, trainer: int = 0) -> torch.Tensor:
    """Step ``step``'s ids of trainer ``trainer``: hot ids every step, ids seen once, ids seen
    at two steps two apart (the same for every trainer: distinct steps, not trainers, count),
    and a trainer's own ids; repeats inside the batch."""
    hot = torch.arange(0, 12)
    once = 1000 + step * 20 + trainer * 10 + torch.arange(10)
    twice = 3000 + (step // 2) * 6 + torch.arange(6) if step % 4 < 2 else 3000 + ((step - 2) // 2) * 6 + torch.arange(6)
    return torch.cat([hot, once, twice, hot[:3]])


def weights(step: int, trainer: int, n: int) -> torch.Tensor:
    return torch.randn(n, DIM, generator=torch.Generator().manual_seed(100 * step + trainer))


def train_step(emb, step: int, trainer: int = 0) -> None:
    """One step of ``emb`` on trainer ``trainer``'s batch of step ``step``."""
    ids = batch(step, trainer)
    (emb(ids) * weights(step, trainer, ids.numel())).sum().backward()
    emb.step()


def table(name: str, servers: list[str], **kwargs):
    from remote_module.ps import ShardedEmbedding

    kwargs = {"optimizer": (torch.optim.SGD, {"lr": LR}), "init": "lazy", **kwargs}
    return ShardedEmbedding(ROWS, DIM, servers, name=name, min_block_size=ROWS // 2 * DIM, **kwargs)


def train(name: str, steps: int, kwargs: dict, trainer: int = 0, num_trainers: int = 1, ps_mode: str = "async",
          eval_every: int = 3) -> dict:
    """``steps`` steps of a lazy table on ps0, ps1 (an eval lookup under ``no_grad`` every
    ``eval_every`` steps, which must not count); every row looked up, as read after, and the
    table's stats."""
    emb = table(name, ["ps0", "ps1"], ps_mode=ps_mode, num_trainers=num_trainers, **kwargs)
    for s in range(steps):
        train_step(emb, s, trainer)
        if s % eval_every == 0:
            with torch.no_grad():
                emb(batch(s + 1, trainer))
    seen = torch.arange(ROWS)
    with torch.no_grad():
        rows = emb(seen)
    return {"rows": rows, "stats": emb.table_stats()}


def initial(name: str, ids: torch.Tensor) -> torch.Tensor:
    from remote_module.ps.tables.server._initial import initial_rows, row_key

    return initial_rows(row_key(0, name), ids, DIM)


def checkpoint(emb) -> dict:
    return {"model": emb.state_dict(), "optim": emb.optimizer_state_dict()}


def restore_and_continue(name: str, before: int, after: int, kwargs: dict) -> dict:
    """Train ``before`` steps on ps0, checkpoint, train ``after`` more: the end; and the same
    table (same name, so the same initial rows) on ps1 loaded from the checkpoint, trained the
    same ``after`` steps: its end."""
    ends = {}
    first = table(name, ["ps0"], **kwargs)
    for s in range(before):
        train_step(first, s)
    saved = checkpoint(first)
    second = table(name, ["ps1"], **kwargs)
    second.load_state_dict(saved["model"])
    second.load_optimizer_state_dict(saved["optim"])
    for label, emb in (("continued", first), ("restored", second)):
        for s in range(before, before + after):
            train_step(emb, s)
        with torch.no_grad():
            rows = emb(torch.arange(ROWS))
        ends[label] = {"rows": rows, **checkpoint(emb), "stats": emb.table_stats()}
    return ends


def deltas(name: str, rounds: int, per_round: int, kwargs: dict) -> dict:
    """A table on ps0, ps1 trained ``rounds`` x ``per_round`` steps with a delta after each
    round (token "a"; token "b" takes deltas at other times, which must not disturb "a"'s), its
    checkpoint before and at the end; then a table of the same rows on ps0, ps1, ps2 loaded
    from the first checkpoint and the deltas in order: its checkpoint."""
    emb = table(name, ["ps0", "ps1"], **kwargs)
    step = 0

    def train_for(n: int) -> None:
        nonlocal step
        for _ in range(n):
            train_step(emb, step)
            step += 1

    train_for(per_round)
    full = checkpoint(emb)
    emb.delta_state_dict("a")  # (the baseline: the whole table)
    taken = []
    for r in range(rounds):
        train_for(per_round)
        if r % 2 == 0:
            emb.delta_state_dict("b")
        taken.append(emb.delta_state_dict("a"))
    end = checkpoint(emb)
    other = table(name + "-3", ["ps0", "ps1", "ps2"], **kwargs)
    other.load_state_dict(full["model"])
    other.load_optimizer_state_dict(full["optim"])
    for d in taken:
        other.load_delta_state_dict(d)
    return {"end": end, "loaded": checkpoint(other), "sizes": [d["ids"].numel() for d in taken],
            "evicted": [d["evicted"].numel() for d in taken]}


def delta_bytes(name: str) -> dict:
    """An eager 1,000,000 x 16 table on ps0, ps1: the bytes of a full checkpoint and of a delta
    after a step touching 1,000 rows."""
    from remote_module.ps import ShardedEmbedding

    emb = ShardedEmbedding(1_000_000, 16, ["ps0", "ps1"], name=name, optimizer=(torch.optim.Adagrad, {"lr": 0.1}))
    ids = torch.arange(0, 1_000_000, 1000)
    emb(ids).sum().backward()
    emb.step()
    full = checkpoint(emb)
    emb.delta_state_dict("t")
    ids = torch.arange(1, 1_000_000, 1000)  # another 1,000 rows
    emb(ids).sum().backward()
    emb.step()
    delta = emb.delta_state_dict("t")
    return {"full": _nbytes(full), "delta": _nbytes(delta), "rows": delta["ids"].numel()}


def admission_delta_bytes(name: str) -> dict:
    """A lazy 1,000,000 x 16 table with admit_after=2 (the default sketch) on ps0: the bytes of
    a full checkpoint and of a delta after a step counting 1,000 new ids (none admitted)."""
    from remote_module.ps import ShardedEmbedding

    emb = ShardedEmbedding(1_000_000, 16, ["ps0"], name=name, init="lazy", admit_after=2)
    full = checkpoint(emb)
    emb.delta_state_dict("t")
    emb(torch.arange(1, 1_000_000, 1000)).sum().backward()
    emb.step()
    delta = emb.delta_state_dict("t")
    return {"full": _nbytes(full), "delta": _nbytes(delta), "rows": delta["ids"].numel()}


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def bad(kwargs: dict) -> str:
    try:
        table("bad", ["ps0"], **kwargs)
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def collection_train(name: str, steps: int, collect: bool) -> dict:
    """A sum and a mean lazy bag table with admission and eviction, trained in a collection
    (its packed lookups and pushes; on ps0 and ps1) or one by one (the same tables on ps2):
    outputs, rows after and stats."""
    from remote_module.ps import ShardedEmbeddingBag, ShardedEmbeddingBagCollection

    placed = (("sum", ["ps0", "ps1"]), ("mean", ["ps1"])) if collect else (("sum", ["ps2"]), ("mean", ["ps2"]))
    tables = {mode: ShardedEmbeddingBag(ROWS, DIM, servers, name=f"{name}-{mode}", mode=mode, init="lazy",
                                        admit_after=2, evict_after_steps=3, min_block_size=ROWS // 2 * DIM,
                                        optimizer=(torch.optim.SGD, {"lr": LR}))
              for mode, servers in placed}
    model = ShardedEmbeddingBagCollection(tables) if collect else None
    outs = []
    for s in range(steps):
        feats = {"sum": batch(s)[:28].reshape(7, 4), "mean": batch(s + 1)[:28].reshape(7, 4)}
        got = model(feats) if collect else {k: t(feats[k]) for k, t in tables.items()}
        outs.append({k: v.detach() for k, v in got.items()})
        sum((v * weights(s, 0, 7)).sum() for v in got.values()).backward()
        if collect:
            model.step()
        else:
            for t in tables.values():
                t.step()
    with torch.no_grad():
        rows = {k: t(torch.arange(ROWS).reshape(-1, 1)) for k, t in tables.items()}
    stats = model.table_stats() if collect else {k: t.table_stats() for k, t in tables.items()}
    return {"outs": outs, "rows": rows, "stats": stats}


def delta_order(name: str) -> list[str]:
    """Deltas loaded out of order are refused; in order (one loaded twice) they load."""
    emb = table(name, ["ps0", "ps1"])
    out = []

    train_step(emb, 0)
    base = emb.delta_state_dict("t")
    train_step(emb, 1)
    first = emb.delta_state_dict("t")
    train_step(emb, 2)
    second = emb.delta_state_dict("t")
    other = table(name + "-copy", ["ps2"])
    for label, delta in (("base", base), ("second", second), ("first", first), ("first again", first),
                         ("second", second)):
        try:
            other.load_delta_state_dict(delta)
            out.append(f"{label}: ok")
        except ValueError as exc:
            out.append(f"{label}: ValueError: {exc}")
    return out


def load_replaces(name: str) -> dict:
    """A lazy table (no admission, no eviction) trained on rows 1-3, saved, trained on 4-5,
    loaded back: as a local module's load, the rows are the saved ones (4, 5 at their init)."""
    emb = table(name, ["ps0", "ps1"])
    for ids in ([1, 2, 3], [4, 5, 3000]):
        emb(torch.tensor(ids)).sum().backward()
        emb.step()
        if ids[0] == 1:
            saved = {k: v.clone() for k, v in emb.state_dict().items()}
    emb.load_state_dict(saved)
    with torch.no_grad():
        rows = emb(torch.arange(6))
    return {"ids": emb.state_dict()["weight.ids"].tolist(), "rows": rows, "saved": saved["weight.rows"],
            "stats": emb.table_stats()}


def delta_after_a_checkpoint(name: str) -> dict:
    """A loader follows deltas, then loads a full checkpoint taken after its last delta, then
    the delta taken after that checkpoint: what it holds then, and the source's."""
    emb = table(name, ["ps0", "ps1"])

    train_step(emb, 0)
    base = emb.delta_state_dict("t")
    train_step(emb, 1)
    emb.delta_state_dict("t")  # (a delta the loader never sees: the checkpoint below holds its changes)
    train_step(emb, 2)
    full = checkpoint(emb)
    train_step(emb, 3)
    after = emb.delta_state_dict("t")
    loader = table(name + "-copy", ["ps2"])
    loader.load_delta_state_dict(base)
    loader.load_state_dict(full["model"])
    loader.load_optimizer_state_dict(full["optim"])
    try:
        loader.load_delta_state_dict(after)
        error = None
    except ValueError as exc:
        error = f"ValueError: {exc}"
    return {"error": error, "source": emb.state_dict(), "loader": loader.state_dict()}
