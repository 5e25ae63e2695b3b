"""What tests/ps/test_table_checkpoints.py runs on its trainers: weights-only loads of tables
that keep optimizer state, delta chains of several trainers sharing a token, and optimizer
state of another optimizer refused. Tables live here between calls (``_held``), so pytest can
interleave the trainers' calls in a fixed order."""

from __future__ import annotations

from typing import Any

import torch

ROWS, DIM = 40, 3
ADAGRAD = (torch.optim.Adagrad, {"lr": 0.5})
SPARSE_ADAM = (torch.optim.SparseAdam, {"lr": 0.05})

#: this trainer's tables by job name, between calls
_held: dict[str, Any] = {}


def bag(name: str, servers: list[str], init: str = "lazy", optimizer: tuple = ADAGRAD, **kwargs: Any):
    from remote_module.ps import ShardedEmbeddingBag

    return ShardedEmbeddingBag(ROWS, DIM, servers, name=name, mode="sum", init=init, optimizer=optimizer,
                               min_block_size=ROWS // 2 * DIM, **kwargs)


def initial(name: str) -> torch.Tensor:
    """Every row's first value of the table ``name`` (seed 0): a local module's weight."""
    from remote_module.ps.tables.server._initial import initial_rows, row_key

    return initial_rows(row_key(0, name), torch.arange(ROWS), DIM)


#: each step's bags (input, offsets): rows 4, 5 first stepped after the checkpoint (step 1)
BAGS = [(torch.tensor([1, 2, 3, 1]), torch.tensor([0, 2])),
        (torch.tensor([3, 4, 5, 4]), torch.tensor([0, 1])),
        (torch.tensor([2, 3, 4, 5, 6]), torch.tensor([0, 3]))]


def bag_weights(k: int) -> torch.Tensor:
    return torch.randn(2, DIM, generator=torch.Generator().manual_seed(10 + k))


def every_row(module: Any) -> torch.Tensor:
    """Each row of a bag module (sharded or local), as a one-row bag."""
    with torch.no_grad():
        return module(torch.arange(ROWS), torch.arange(ROWS)).detach().clone()


def weights_only_load(name: str, init: str) -> dict:
    """An Adagrad bag table stepped on BAGS[0], saved (weights only), stepped on BAGS[1],
    loaded back (weights only), stepped on BAGS[2]: its rows after the load and at the end,
    and its optimizer state at the end."""
    emb = bag(name, ["ps0", "ps1"], init)

    def step(k: int) -> None:
        (emb(*BAGS[k]) * bag_weights(k)).sum().backward()
        emb.step()

    step(0)
    saved = emb.state_dict()
    step(1)
    emb.load_state_dict(saved)
    loaded = every_row(emb)
    step(2)
    state = emb.optimizer_state_dict()
    return {"loaded": loaded, "rows": every_row(emb), "ids": state["ids"], "sum": state["sum"],
            "step": state["step"]}


def weights_then_optimizer(name: str) -> dict:
    """A lazy Adagrad table: a full checkpoint after BAGS[0], a step on BAGS[1], then the
    checkpoint loaded (weights first): its stored ids, optimizer state ids and rows held."""
    emb = bag(name, ["ps0", "ps1"])
    for k in (0, 1):
        (emb(*BAGS[k]) * bag_weights(k)).sum().backward()
        emb.step()
        if k == 0:
            saved = emb.state_dict(), emb.optimizer_state_dict()
    emb.load_state_dict(saved[0])
    emb.load_optimizer_state_dict(saved[1])
    return {"ids": emb.state_dict()["weight.ids"].tolist(), "state_ids": emb.optimizer_state_dict()["ids"].tolist(),
            "held": emb.table_stats()["rows_held"], "saved_ids": saved[0]["weight.ids"].tolist()}


# ---- delta chains of several trainers ----------------------------------------------------------


def checkpoint(emb: Any) -> dict:
    return {"model": emb.state_dict(), "optim": emb.optimizer_state_dict()}


def chain_table(name: str) -> None:
    """This trainer's object of the shared lazy Adagrad table ``name`` (on ps0, ps1)."""
    _held[name] = bag(name, ["ps0", "ps1"], num_trainers=2)


def chain_step(name: str, k: int, trainer: int) -> None:
    """One step of this trainer: ids 1-3 (every trainer's) and two of its own."""
    emb = _held[name]
    own = 10 + 4 * k + 2 * trainer
    ids = torch.tensor([1, 2, 3, own, own + 1, 2])
    weights = torch.randn(2, DIM, generator=torch.Generator().manual_seed(100 * k + trainer))
    (emb(ids, torch.tensor([0, 3])) * weights).sum().backward()
    emb.step()


def chain_delta(name: str, token: str = "ckpt") -> dict:
    return _held[name].delta_state_dict(token)


def chain_checkpoint(name: str) -> dict:
    return checkpoint(_held[name])


def _through_a_file(value: Any) -> Any:
    """``value`` torch.save()d and loaded back (torch's default, weights_only=True)."""
    import io

    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def restore(name: str, full: dict, deltas: list[dict], saved: bool = False) -> dict:
    """A table of the same rows on ps2 loaded from ``full`` (``saved``: through a file) and
    then ``deltas`` in order: its checkpoint."""
    loader = bag(name, ["ps2"])
    loader.load_state_dict(_through_a_file(full["model"]) if saved else full["model"])
    loader.load_optimizer_state_dict(full["optim"])
    for d in deltas:
        loader.load_delta_state_dict(d)
    return checkpoint(loader)


def refused(name: str, full: dict, loaded: list[dict], delta: dict, collection: bool = False,
            copied: bool = False) -> dict:
    """A table on ps2 loaded from ``full`` and the deltas ``loaded``, then ``delta``: the
    error (None if it loaded) and the table's checkpoint before and after. ``collection``:
    the table inside a collection, whose load is given ``{"t": delta}``; ``copied``: ``full``'s
    state_dict copied key by key into a dict (its metadata lost)."""
    from remote_module.ps import ShardedEmbeddingBagCollection

    loader = bag(name, ["ps2"])
    loader.load_state_dict(dict(full["model"]) if copied else full["model"])
    loader.load_optimizer_state_dict(full["optim"])
    for d in loaded:
        loader.load_delta_state_dict(d)
    before = checkpoint(loader)
    target = ShardedEmbeddingBagCollection({"t": loader}) if collection else loader
    try:
        target.load_delta_state_dict({"t": delta} if collection else delta)
        error = None
    except ValueError as exc:
        error = f"ValueError: {exc}"
    return {"error": error, "before": before, "after": checkpoint(loader)}


# ---- another optimizer's state ------------------------------------------------------------------


def _trained(emb: Any, ids: list[int]) -> Any:
    (emb(torch.tensor(ids), torch.tensor([0])) * 1.5).sum().backward()
    emb.step()
    return emb


def _caught(load: Any) -> str | None:
    try:
        load()
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _table_state(emb: Any) -> dict:
    return {"optim": emb.optimizer_state_dict(), "ps_optimizer": emb.ps_optimizer.state_dict(),
            "model": emb.state_dict()}


def foreign_optimizer_state(name: str, how: str) -> dict:
    """Adagrad's state (``how``: its ``optimizer_state_dict()``, or a delta) loaded into a
    SparseAdam table (``"geo"``: in geo mode): the error, the table's state before and after."""
    source = _trained(bag(name + "-adagrad", ["ps0"]), [1, 2])
    mode = {"ps_mode": "geo", "geo_push_every": 1} if how == "geo" else {}
    table = _trained(bag(name + "-adam", ["ps0", "ps1"], optimizer=SPARSE_ADAM, **mode), [2, 30])
    before = _table_state(table)
    if how == "delta":
        given = source.delta_state_dict("t")
        error = _caught(lambda: table.load_delta_state_dict(given))
    else:
        given = source.optimizer_state_dict()
        error = _caught(lambda: table.load_optimizer_state_dict(given))
    return {"error": error, "before": before, "after": _table_state(table)}


def foreign_state_in_a_collection(name: str) -> dict:
    """A collection of an Adagrad and a SparseAdam table given Adagrad state for both (the
    first's own, from an earlier step): the error and the collection's state before and after."""
    from remote_module.ps import ShardedEmbeddingBagCollection

    first = _trained(bag(name + "-a", ["ps0", "ps1"]), [1, 2])
    earlier = first.optimizer_state_dict()
    _trained(first, [2, 3])
    second = _trained(bag(name + "-b", ["ps0"], optimizer=SPARSE_ADAM), [5])
    model = ShardedEmbeddingBagCollection({"a": first, "b": second})

    def state() -> dict:
        return {"optim": model.optimizer_state_dict(), "ps_optimizer": model.ps_optimizer.state_dict()}

    before = state()
    error = _caught(lambda: model.load_optimizer_state_dict({"a": earlier, "b": earlier}))
    return {"error": error, "before": before, "after": state()}


class _Net(torch.nn.Module):
    def __init__(self, table: Any) -> None:
        super().__init__()
        self.t, self.head = table, torch.nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.t(ids, torch.tensor([0])))


def foreign_state_in_a_psmodel(name: str) -> dict:
    """A PSModel holding a SparseAdam table and a Linear (Adagrad) given, for the table,
    Adagrad state, and for the Linear its state of an earlier step: the error, the model's
    state before and after."""
    from remote_module.ps import PSModel

    torch.manual_seed(0)
    table = bag(name + "-t", ["ps2"], optimizer=SPARSE_ADAM)
    model = PSModel(_Net(table), ["ps2"], name=name, num_trainers=1, ps_mode="async",
                    optimizer=(torch.optim.Adagrad, {"lr": 0.1}))

    def step() -> None:
        model(torch.tensor([1, 2])).sum().backward()
        model.step()
        model.zero_grad()

    step()
    earlier = model.optimizer_state_dict()
    step()
    given = dict(earlier)
    given["tables"] = {qual: _trained(bag(name + "-adagrad", ["ps0"]), [1]).optimizer_state_dict()
                       for qual in earlier["tables"]}

    def state() -> dict:
        return {"optim": model.optimizer_state_dict(), "model": model.state_dict()}

    before = state()
    error = _caught(lambda: model.load_optimizer_state_dict(given))
    return {"error": error, "before": before, "after": state()}


def unstepped_state_into_geo(name: str) -> dict:
    """The optimizer state of an Adagrad table never stepped (no state key: no row has any)
    loaded into a geo Adagrad table: the error (None if it loaded) and its state after."""
    source = bag(name + "-async", ["ps0"])
    table = bag(name + "-geo", ["ps1"], ps_mode="geo", geo_push_every=1)
    given = source.optimizer_state_dict()
    error = _caught(lambda: table.load_optimizer_state_dict(given))
    return {"error": error, "given": sorted(given), "after": table.optimizer_state_dict()}


def geo_load_with_rows_unpushed(name: str) -> dict:
    """A lazy geo table (pushes every 2 steps) checkpointed after 2 steps, trained one more step
    on rows the checkpoint does not hold (not pushed yet), then loaded from the checkpoint: the
    rows it holds afterwards (``state_dict()`` pushes what is pending first)."""
    emb = bag(name, ["ps0", "ps1"], ps_mode="geo", geo_push_every=2)
    _trained(emb, [1, 2])
    _trained(emb, [3])
    saved = emb.state_dict()
    _trained(emb, [7, 30])  # rows 7 and 30: not in the checkpoint, their deltas not pushed yet
    emb.load_state_dict(saved)
    return {"saved": saved, "after": emb.state_dict()}
