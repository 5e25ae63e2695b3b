"""What tests/ps/test_incremental_saves.py runs on its trainers: tables trained between saves
of a chain (``save_shards(token=..., base=...)``), loaded from its last incremental save beside
a full save taken at the same point."""

from __future__ import annotations

import os
from typing import Any

import torch

from tests.ps._shard_checkpoints_remote import CASES, bag, checkpoint, train

#: the rows the steps between a chain's saves touch (an eager table's server writes its blocks
#: whole once its changed rows with their ids would take as many bytes)
CHANGING = torch.arange(0, 60, 3)


def chain_and_full(name: str, case: str, directory: str, servers: int = 3) -> dict:
    """A table of ``case`` on ps0, ps1: trained 6 steps, saved whole (token "chain"), then
    twice trained 5 steps (on the rows ``CHANGING``) and saved incrementally on the save before; at the end also a full
    save. Both loaded onto ``servers`` servers (each table trained 2 steps of its own first):
    their checkpoints, the manifests and each save's bytes."""
    from remote_module.ps import load_shards, save_shards

    # (an eager row evicted goes back to its first value: a change; evicted after 3 steps, most
    # rows would change between saves, and the servers would write their blocks whole)
    slower = {"evict_after_steps": 8} if CASES[case].get("evict_after_steps") and CASES[case]["init"] == "eager" \
        else {}
    source = bag(name, ["ps0", "ps1"], case, **slower)
    train(source, range(6))
    saves = [os.path.join(directory, f"s{i}") for i in range(3)]
    manifests = [save_shards(saves[0], {"emb": source}, token="chain")]
    for i, at in enumerate(range(6, 16, 5), start=1):
        train(source, range(at, at + 5), among=CHANGING)  # (a third of the rows: an eager delta pays)
        manifests.append(save_shards(saves[i], {"emb": source}, token="chain", base=saves[i - 1]))
    full = os.path.join(directory, "full")
    save_shards(full, {"emb": source})
    on = [f"ps{i}" for i in range(servers)]
    out: dict[str, Any] = {"manifests": manifests, "source": checkpoint(source)}
    for label, path in (("chain", saves[-1]), ("full", full)):
        target = bag(f"{name}-{label}", on, case, **slower)
        train(target, range(100, 102))  # (rows and state of its own before the load)
        load_shards(path, {"emb": target})
        out[label] = checkpoint(target)
        train(target, range(20, 23))  # (and it trains on the same)
        out[f"{label} after"] = checkpoint(target)
    if CASES[case]["init"] == "lazy":  # (rows not stored read as each table name's first values)
        for key in ("source", "chain", "full", "chain after", "full after"):
            out[key].pop("rows")
    out["bytes"] = [sum(e["bytes"] for rel, e in m["files"].items() if rel.startswith("emb.ps")) for m in manifests]
    return out


def few_rows_changed(name: str, directory: str) -> dict:
    """An eager table of 60 rows saved whole, then one step touching at most 12 rows and an
    incremental save: both saves' files (by server) and the manifests."""
    from remote_module.ps import save_shards

    emb = bag(name, ["ps0", "ps1"], "eager-sgd")
    train(emb, range(3))
    first = save_shards(os.path.join(directory, "a"), {"emb": emb}, token="t")
    train(emb, range(3, 4))
    second = save_shards(os.path.join(directory, "b"), {"emb": emb}, token="t", base=os.path.join(directory, "a"))
    return {"first": first, "second": second}


def chain_then_load(name: str, directory: str, case: str = "eager-sgd") -> dict:
    """A chain of three saves (full, incremental, incremental) of a table on ps0, ps1."""
    from remote_module.ps import save_shards

    emb = bag(name, ["ps0", "ps1"], case)
    train(emb, range(3))
    saves = [os.path.join(directory, f"s{i}") for i in range(3)]
    save_shards(saves[0], {"emb": emb}, token="t")
    for i in (1, 2):
        train(emb, range(3 * i, 3 * i + 3))
        save_shards(saves[i], {"emb": emb}, token="t", base=saves[i - 1])
    return {"checkpoint": checkpoint(emb), "saves": saves}


def load_or_error(name: str, path: str, case: str = "eager-sgd") -> dict:
    """Load ``path`` into a new table of ``case`` on ps0-ps2 trained two steps: the error (None
    if it loaded) and the table's checkpoint before and after."""
    from remote_module.ps import load_shards

    emb = bag(name, ["ps0", "ps1", "ps2"], case)
    train(emb, range(200, 202))
    before = checkpoint(emb)
    try:
        load_shards(path, {"emb": emb})
        error = None
    except Exception as e:  # noqa: BLE001 - the test asserts its type and message
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "before": before, "after": checkpoint(emb)}


def refused_saves(name: str, directory: str) -> dict:
    """The errors of incremental saves given a bad base or token; whether anything was written."""
    from remote_module.ps import save_shards

    emb = bag(name, ["ps0", "ps1"], "eager-sgd")
    train(emb, range(2))
    base = os.path.join(directory, "base")
    save_shards(base, {"emb": emb}, token="t")
    plain = os.path.join(directory, "plain")
    save_shards(plain, {"emb": emb})
    out = {}
    for label, kwargs in {"no token": {"base": base}, "other token": {"token": "u", "base": base},
                          "base without token": {"token": "t", "base": plain},
                          "torn base": {"token": "t", "base": os.path.join(directory, "nothing")},
                          "itself": {"token": "t", "base": os.path.join(directory, "x")},
                          "other layout": {"token": "t", "base": base, "layout": "local"},
                          "empty token": {"token": ""}}.items():
        target = os.path.join(directory, "x")
        try:
            save_shards(target, {"emb": emb}, **kwargs)
            out[label] = None
        except Exception as e:  # noqa: BLE001
            out[label] = f"{type(e).__name__}: {e}"
        out[label + " wrote"] = os.path.exists(target)
    # a base whose own base is gone; a base that is an incremental save on the directory saved into
    on_base = os.path.join(directory, "on-base")
    save_shards(on_base, {"emb": emb}, token="t", base=base)
    for label, target, kwargs in (("base on the target", base, {"token": "t", "base": on_base}),):
        try:
            save_shards(target, {"emb": emb}, **kwargs)
            out[label] = None
        except Exception as e:  # noqa: BLE001
            out[label] = f"{type(e).__name__}: {e}"
    os.rename(os.path.join(base, "manifest.json"), os.path.join(base, "manifest.away"))
    try:
        save_shards(os.path.join(directory, "y"), {"emb": emb}, token="t", base=on_base)
        out["broken base"] = None
    except Exception as e:  # noqa: BLE001
        out["broken base"] = f"{type(e).__name__}: {e}"
    out["broken base wrote"] = os.path.exists(os.path.join(directory, "y"))
    return out


def after_a_new_table(name: str, directory: str) -> dict:
    """A table saved whole (token "t"); a new table object of the same name on the servers
    (made again there: a new life); then an incremental save on the first: its manifest, and
    the table's checkpoint beside the one loaded from it."""
    from remote_module.ps import load_shards, save_shards

    emb = bag(name, ["ps0", "ps1"], "eager-sgd")
    train(emb, range(3))
    save_shards(os.path.join(directory, "a"), {"emb": emb}, token="t")
    train(emb, range(3, 5))
    for server in ("ps0", "ps1"):  # (as a restarted server's table: a new life, its versions afresh)
        torch.distributed.rpc.rpc_sync(server, _new_life, args=(name,))
    second = save_shards(os.path.join(directory, "b"), {"emb": emb}, token="t", base=os.path.join(directory, "a"))
    again = bag(name + "-again", ["ps0", "ps1", "ps2"], "eager-sgd")
    load_shards(os.path.join(directory, "b"), {"emb": again})
    return {"manifest": second, "saved": checkpoint(emb), "loaded": checkpoint(again)}


def _new_life(name: str) -> None:
    import uuid

    from remote_module.ps.tables.server._handlers import _table

    _table(name).incarnation = uuid.uuid4().hex


def job_with_chains(name: str, directory: str, case: str, steps: int, full_every: int, keep: int) -> dict:
    """A table on ps0, ps1 trained ``steps`` steps under a ``Checkpointer`` saving every 2 with a
    full save every ``full_every``: the table's checkpoint at each save (by step), the
    checkpoints left and each one's base (its ps/ manifest's), and the checkpointer's stats."""
    import json

    from remote_module.ps import Checkpointer

    emb = bag(name, ["ps0", "ps1"], case)
    ckpt = Checkpointer(directory, every_steps=2, keep=keep, ps={"emb": emb}, trainers=["trainer0"],
                        full_every=full_every)
    held = {}
    for k in range(ckpt.resume(), steps):
        train(emb, range(k, k + 1))
        if ckpt.step() is not None:
            held[ckpt.step_index] = checkpoint(emb)
    ckpt.close()
    import torch.distributed.rpc as rpc

    chains = {server: rpc.rpc_sync(server, _chains_kept, args=(name,)) for server in ("ps0", "ps1")}
    left = sorted(d for d in os.listdir(directory) if d.startswith("step-"))
    bases = {}
    for d in left:
        with open(os.path.join(directory, d, "ps", "manifest.json")) as f:
            base = json.load(f)["base"]
        bases[d] = None if base is None else base["path"]
    if CASES[case]["init"] == "lazy":
        for value in held.values():
            value.pop("rows")
    return {"held": held, "left": left, "bases": bases, "stats": ckpt.stats(), "chains after close": chains}


def _chains_kept(name: str) -> list[str]:
    """The chains of incremental saves table ``name`` keeps dropped ids for here."""
    from remote_module.ps.tables.server._handlers import _table

    return [key[0] for key in _table(name).tombstones.baselines if key[0].startswith("save_shards ")]


def job_resumed_and_trained(name: str, directory: str, case: str, until: int, full_every: int) -> dict:
    """A fresh table resumed by a ``Checkpointer`` from ``directory``: the step it resumed
    from, the table's checkpoint then, and after training (and saving) on to step ``until``."""
    import warnings

    from remote_module.ps import Checkpointer

    emb = bag(name, ["ps0", "ps1"], case)
    ckpt = Checkpointer(directory, every_steps=2, keep=8, ps={"emb": emb}, trainers=["trainer0"],
                        full_every=full_every)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        start = ckpt.resume()
    out = {"start": start, "warnings": [str(w.message) for w in said], "resumed": checkpoint(emb)}
    for k in range(start, until):
        train(emb, range(k, k + 1))
        ckpt.step()
    ckpt.close()
    out["end"] = checkpoint(emb)
    if CASES[case]["init"] == "lazy":
        out["resumed"].pop("rows"), out["end"].pop("rows")
    return out


def job_whose_base_was_lost(name: str, directory: str) -> dict:
    """A ``Checkpointer`` (full_every=3, saving every 2 steps) whose checkpoint of step 2 loses
    its ps/ manifest once complete: what each save after it raised (none) or warned, the
    checkpoints left and each one's base."""
    import json
    import warnings

    from remote_module.ps import Checkpointer

    emb = bag(name, ["ps0", "ps1"], "eager-sgd")
    ckpt = Checkpointer(directory, every_steps=2, keep=8, ps={"emb": emb}, trainers=["trainer0"], full_every=3)
    ckpt.resume()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for k in range(6):
            train(emb, range(k, k + 1))
            ckpt.step()
            if k == 1:  # (step 2's checkpoint complete first)
                ckpt._finish(wait=True)
                ckpt._drain()
                os.remove(os.path.join(directory, "step-00000002", "ps", "manifest.json"))
        ckpt.close()
    bases = {}
    for d in sorted(d for d in os.listdir(directory) if d.startswith("step-") and d != "step-00000002"):
        with open(os.path.join(directory, d, "ps", "manifest.json")) as f:
            base = json.load(f)["base"]
        bases[d] = None if base is None else base["path"]
    return {"warnings": [str(w.message) for w in said], "bases": bases}


def resumed_and_resumed_again(name: str, directory: str, until: int, full_every: int, keep: int) -> dict:
    """A ``Checkpointer`` resumed (a fresh table) from ``directory`` and trained (saving every 2
    steps) to ``until``; then another resumed, as after a crash: the steps each resumed from
    and the checkpoints left in between."""
    import warnings

    from remote_module.ps import Checkpointer

    def resumed(suffix):
        emb = bag(name + suffix, ["ps0", "ps1"], "eager-sgd")
        ckpt = Checkpointer(directory, every_steps=2, keep=keep, ps={"emb": emb}, trainers=["trainer0"],
                            full_every=full_every)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return emb, ckpt, ckpt.resume()

    emb, ckpt, start = resumed("")
    for k in range(start, until):
        train(emb, range(k, k + 1))
        ckpt.step()
    ckpt.close()
    left = sorted(d for d in os.listdir(directory) if d.startswith("step-"))
    _, again, then = resumed("-again")
    again.close()
    return {"start": start, "left": left, "again": then}


def checkpointer_given_a_table_twice(name: str, directory: str) -> dict:
    """A ``Checkpointer`` given a table alone and inside a collection (``ps={"emb": t, "all":
    ebc}``): the error and when it came (building it, or at the first save); what was saved."""
    from remote_module.ps import Checkpointer, ShardedEmbeddingBagCollection

    emb = bag(name, ["ps0", "ps1"], "eager-sgd")
    ebc = ShardedEmbeddingBagCollection({"emb": emb})
    out: dict[str, Any] = {"at": None, "error": None}
    try:
        ckpt = Checkpointer(directory, every_steps=2, ps={"emb": emb, "all": ebc}, trainers=["trainer0"])
        out["at"] = "first save"
        for k in range(ckpt.resume(), 2):
            train(emb, range(k, k + 1))
            ckpt.step()
        ckpt.close()
        out["at"] = None
    except Exception as e:  # noqa: BLE001 - the test asserts its type and message
        out["at"] = out["at"] or "built"
        out["error"] = f"{type(e).__name__}: {e}"
    out["left"] = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    return out


def resume_error(name: str, directory: str) -> str | None:
    """A fresh table's ``Checkpointer.resume()`` from ``directory``: its error (None if it resumed)."""
    from remote_module.ps import Checkpointer

    emb = bag(name, ["ps0", "ps1"], "eager-sgd")
    ckpt = Checkpointer(directory, every_steps=2, keep=8, ps={"emb": emb}, trainers=["trainer0"], full_every=3)
    try:
        ckpt.resume()
    except Exception as e:  # noqa: BLE001 - the test asserts its type and message
        return f"{type(e).__name__}: {e}"
    finally:
        ckpt.close()
    return None


def most_rows_changed(name: str, directory: str) -> dict:
    """An eager table of 60 rows saved whole (token "t"), trained 10 steps of 12 ids (most rows
    change), saved on that save: the second save's manifest."""
    from remote_module.ps import save_shards

    emb = bag(name, ["ps0", "ps1"], "eager-sgd")
    save_shards(os.path.join(directory, "a"), {"emb": emb}, token="t")
    train(emb, range(10))
    return save_shards(os.path.join(directory, "b"), {"emb": emb}, token="t", base=os.path.join(directory, "a"))


def chain_ended(name: str, directory: str) -> dict:
    """A table saved with token "t", then ``end_save_chain``: the chains its servers keep
    dropped ids for, before and after."""
    import torch.distributed.rpc as rpc

    from remote_module.ps import end_save_chain, save_shards

    emb = bag(name, ["ps0", "ps1"], "eager-sgd")
    save_shards(directory, {"emb": emb}, token="t")
    before = {server: rpc.rpc_sync(server, _chains_kept, args=(name,)) for server in ("ps0", "ps1")}
    end_save_chain({"emb": emb}, "t")
    return {"before": before, "after": {server: rpc.rpc_sync(server, _chains_kept, args=(name,))
                                        for server in ("ps0", "ps1")}}
