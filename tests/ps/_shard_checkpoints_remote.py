"""What tests/ps/test_shard_checkpoints.py runs on its trainers: tables trained, saved with
``save_shards`` (each server writing its own blocks) and loaded with ``load_shards``, beside the
same tables through ``state_dict()`` / ``optimizer_state_dict()``."""

from __future__ import annotations

import os
import threading
import time
from functools import partial
from typing import Any

import torch

ROWS, DIM = 60, 4

#: the tables the tests train, by case: ShardedEmbeddingBag keyword arguments
CASES: dict[str, dict[str, Any]] = {
    "lazy-adagrad-admission-eviction": {"init": "lazy", "optimizer": (torch.optim.Adagrad, {"lr": 0.3}),
                                        "admit_after": 2, "admit_sketch_bytes": 4096, "evict_after_steps": 4},
    "eager-sgd": {"init": "eager", "optimizer": (torch.optim.SGD, {"lr": 0.5})},
    "eager-sparse-adam-eviction": {"init": "eager", "optimizer": (torch.optim.SparseAdam, {"lr": 0.05}),
                                   "evict_after_steps": 3},
    # geo: the optimizer state is the trainer's (its file), the rows the servers'
    "lazy-adagrad-geo": {"init": "lazy", "optimizer": (torch.optim.Adagrad, {"lr": 0.3}), "ps_mode": "geo",
                         "geo_push_every": 2},
}


def bag(name: str, servers: list[str], case: str, **kwargs: Any) -> Any:
    from remote_module.ps import ShardedEmbeddingBag

    return ShardedEmbeddingBag(ROWS, DIM, servers, name=name, mode="sum", min_block_size=ROWS // 4 * DIM,
                               **{**CASES[case], **kwargs})


def batch(k: int, among: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step ``k``'s bags (input, offsets) and the weights of their sum (fixed by ``k``); ids
    ``among`` those given, else any."""
    g = torch.Generator().manual_seed(k)
    ids = torch.randint(0, ROWS, (12,), generator=g)
    if among is not None:
        ids = among[ids % among.numel()]
    return ids, torch.tensor([0, 5, 9]), torch.randn(3, DIM, generator=g)


def train(emb: Any, steps: range, among: torch.Tensor | None = None) -> None:
    for k in steps:
        ids, offsets, weights = batch(k, among)
        (emb(ids, offsets) * weights).sum().backward()
        emb.step()


def every_row(emb: Any) -> torch.Tensor:
    with torch.no_grad():
        return emb(torch.arange(ROWS), torch.arange(ROWS)).detach().clone()


def checkpoint(emb: Any) -> dict:
    """Everything a table's trainer-side checkpoint holds (admission counts and eviction clocks
    included: ``_extra_state``, ``weight.last_step``) and its rows as looked up."""
    return {"model": dense(emb.state_dict()), "optim": emb.optimizer_state_dict(), "rows": every_row(emb)}


def dense(value: Any) -> Any:
    """``value`` with every sparse tensor in it dense (a sketch of few counts is kept sparse;
    ``torch.equal`` compares dense ones)."""
    if isinstance(value, torch.Tensor):
        return value.to_dense() if value.is_sparse else value
    if isinstance(value, dict):
        return {k: dense(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(dense(v) for v in value)
    return value


def saved_and_loaded(name: str, case: str, directory: str) -> dict:
    """A table of ``case`` on ps0, ps1 trained 6 steps and saved with save_shards; loaded onto
    ps0-ps2 by load_shards and, as the reference, by load_state_dict + load_optimizer_state_dict:
    both tables' checkpoints, the manifest and the files written."""
    from remote_module.ps import load_shards, save_shards

    source = bag(name, ["ps0", "ps1"], case)
    train(source, range(6))
    manifest = save_shards(directory, {"emb": source})
    model, optim = source.state_dict(), source.optimizer_state_dict()
    by_shards = bag(name + "-shards", ["ps0", "ps1", "ps2"], case)
    train(by_shards, range(100, 102))  # (it holds rows and state of its own before the load)
    load_shards(directory, {"emb": by_shards})
    by_state_dict = bag(name + "-state-dict", ["ps0", "ps1", "ps2"], case)
    train(by_state_dict, range(100, 102))
    by_state_dict.load_state_dict(model)
    by_state_dict.load_optimizer_state_dict(optim)
    out = {"shards": checkpoint(by_shards), "state_dict": checkpoint(by_state_dict), "manifest": manifest,
           "files": sorted(os.listdir(directory))}
    if CASES[case]["init"] == "lazy":  # (rows not stored read as the table name's first values)
        out["shards"].pop("rows"), out["state_dict"].pop("rows")
    return out


def two_then_three(name: str, directory: str, lazy: bool) -> dict:
    """Sync SGD: a table on ps0, ps1 trained 5 steps, saved, trained 5 more; a table on ps0-ps2
    loaded from the save and trained the same 5 steps: both tables' checkpoints at the end.
    ``lazy``: the steps after the save touch only rows it holds (a lazy row first stored later
    starts from its table name's first value, and the two tables have two names)."""
    from remote_module.ps import load_shards, save_shards

    case = "eager-sgd"
    kwargs = {"ps_mode": "sync", "num_trainers": 1, **({"init": "lazy"} if lazy else {})}
    two = bag(name, ["ps0", "ps1"], case, **kwargs)
    train(two, range(5))
    save_shards(directory, {"emb": two})
    among = two.state_dict()["weight.ids"] if lazy else None
    train(two, range(5, 10), among)
    three = bag(name + "-on-three", ["ps0", "ps1", "ps2"], case, **kwargs)
    load_shards(directory, {"emb": three})
    train(three, range(5, 10), among)
    out = {"two": checkpoint(two), "three": checkpoint(three)}
    if lazy:  # (compared: the rows stored)
        out["two"].pop("rows"), out["three"].pop("rows")
    return out


def eager_weight(name: str, directory: str, layout: str = "shared") -> dict:
    """An eager table on ps0, ps1 trained and saved: its weight (``state_dict()``)."""
    from remote_module.ps import save_shards

    emb = bag(name, ["ps0", "ps1"], "eager-sgd")
    train(emb, range(4))
    save_shards(directory, {"emb": emb}, layout=layout)
    return {"weight": emb.state_dict()["weight"]}


def refused_load(name: str, directory: str, servers: list[str], case: str = "eager-sgd") -> dict:
    """Load the checkpoint in ``directory`` into a table of ``case`` on ``servers``, trained
    two steps first: the error (None if it loaded) and the table's checkpoint before and after."""
    from remote_module.ps import load_shards

    emb = bag(name, servers, case)
    train(emb, range(200, 202))
    before = checkpoint(emb)
    try:
        load_shards(directory, {"emb": emb})
        error = None
    except (ValueError, TypeError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "before": before, "after": checkpoint(emb)}


def saved(name: str, directory: str, case: str = "eager-sgd", layout: str = "shared") -> dict:
    """A table of ``case`` on ps0, ps1 trained 4 steps and saved: the manifest."""
    from remote_module.ps import save_shards

    emb = bag(name, ["ps0", "ps1"], case)
    train(emb, range(4))
    return save_shards(directory, {"emb": emb}, layout=layout)


def local_layout(name: str, directory: str) -> dict:
    """A table saved in the local layout, loaded onto the same servers and blocks: its
    checkpoint, the loaded one's, and each folder's files."""
    from remote_module.ps import load_shards, save_shards

    emb = bag(name, ["ps0", "ps1"], "eager-sparse-adam-eviction")
    train(emb, range(5))
    manifest = save_shards(directory, {"emb": emb}, layout="local")
    again = bag(name + "-again", ["ps0", "ps1"], "eager-sparse-adam-eviction")
    load_shards(directory, {"emb": again})
    return {"saved": checkpoint(emb), "loaded": checkpoint(again), "manifest": manifest,
            "blocks": {s: list(b) for s, b in again._by_server.items()},
            "files": {d: sorted(os.listdir(os.path.join(directory, d))) if os.path.isdir(os.path.join(directory, d))
                      else None for d in sorted(os.listdir(directory))}}


def collection_round_trip(name: str, directory: str) -> dict:
    """A collection of a lazy and an eager table saved and loaded into another collection:
    both collections' state_dict and optimizer state."""
    from remote_module.ps import ShardedEmbeddingBagCollection, load_shards, save_shards

    def make(suffix: str, servers: list[str]) -> Any:
        return ShardedEmbeddingBagCollection({
            "a": bag(f"{name}-a{suffix}", servers, "lazy-adagrad-admission-eviction"),
            "b": bag(f"{name}-b{suffix}", servers, "eager-sgd")})

    source = make("", ["ps0", "ps1"])
    for k in range(4):
        ids, offsets, weights = batch(k)
        out = source({"a": (ids, offsets), "b": (ids, offsets)})
        ((out["a"] + out["b"]) * weights).sum().backward()
        source.step()
    manifest = save_shards(directory, {"ebc": source})
    target = make("-loaded", ["ps1", "ps2"])
    load_shards(directory, {"ebc": target})
    return {"manifest": manifest, "source": (dense(source.state_dict()), source.optimizer_state_dict()),
            "target": (dense(target.state_dict()), target.optimizer_state_dict())}


def unsupported(name: str, directory: str) -> dict:
    """save_shards given a Linear, and two tables whose keys collide: each error."""
    from remote_module.ps import ShardedEmbeddingBagCollection, save_shards

    out = {}
    collection = ShardedEmbeddingBagCollection({"b": bag(name + "-b", ["ps0"], "eager-sgd")})
    once = bag(name + "-once", ["ps0"], "eager-sgd")
    for case, objects in (("linear", {"model": torch.nn.Linear(2, 2)}),
                          ("collide", {"a": collection, "a.b": bag(name, ["ps1"], "eager-sgd")}),
                          ("twice", {"a": once, "b": once})):
        try:
            save_shards(directory, objects)
            out[case] = "no error"
        except (TypeError, ValueError) as exc:
            out[case] = f"{type(exc).__name__}: {exc}"
    return out


def trainer_bytes(name: str, directory: str, rows: int) -> dict:
    """A lazy table of 10**8 rows holding ``rows`` rows (dim 16) on ps0, ps1, saved and loaded
    onto ps0-ps2: the bytes this trainer received and sent for each (rpc_backend.Traffic)."""
    from remote_module.ps import ShardedEmbeddingBag, load_shards, save_shards
    from rpc_backend import Traffic

    def table(suffix: str, servers: list[str]) -> Any:
        return ShardedEmbeddingBag(10**8, 16, servers, name=name + suffix, init="lazy",
                                   optimizer=(torch.optim.Adagrad, {"lr": 0.1}))

    emb = table("", ["ps0", "ps1"])
    g = torch.Generator().manual_seed(rows)
    ids = torch.unique(torch.randint(0, 10**8, (2 * rows,), generator=g))
    ids = ids[torch.randperm(ids.numel(), generator=g)[:rows]]
    emb(ids, torch.arange(rows)).sum().backward()
    emb.step()
    out = {}
    for what in ("save", "load"):
        target = emb if what == "save" else table("-loaded", ["ps0", "ps1", "ps2"])
        with Traffic() as traffic:
            if what == "save":
                save_shards(directory, {"emb": target})
            else:
                load_shards(directory, {"emb": target})
            traffic.settle()
        out[what] = {"received": sum(traffic.received.values()), "sent": sum(traffic.sent.values()),
                     "messages": sum(traffic.messages.values())}
    out["held"] = target.table_stats()["rows_held"]
    return out


# ---- a server lost during a save ----------------------------------------------------------------

#: this trainer's tables by job name, between calls
_held: dict[str, Any] = {}


def saved_before_a_loss(name: str, directory: str, timeout: float) -> dict:
    """A table on ps0, ps1 trained and saved to ``directory``, kept here: its checkpoint."""
    from remote_module.ps import save_shards

    emb = _held[name] = bag(name, ["ps0", "ps1"], "lazy-adagrad-admission-eviction", timeout=timeout)
    train(emb, range(5))
    save_shards(directory, {"emb": emb})
    return checkpoint(emb)


def save_with_a_server_lost(name: str, directory: str) -> str | None:
    """The kept table saved to ``directory`` (a server of it is gone): the error, or None."""
    from remote_module.ps import save_shards

    try:
        save_shards(directory, {"emb": _held.pop(name)})
    except Exception as exc:  # (what a lost server raises: the test checks it names it)
        return f"{type(exc).__name__}: {exc}"
    return None


def load_after_a_loss(name: str, torn: str, previous: str) -> dict:
    """A table of the same rows on ps0, ps2: the error loading ``torn``, then its checkpoint
    once ``previous`` is loaded."""
    from remote_module.ps import load_shards

    emb = bag(name + "-survivors", ["ps0", "ps2"], "lazy-adagrad-admission-eviction")
    try:
        load_shards(torn, {"emb": emb})
        error = None
    except ValueError as exc:
        error = f"{type(exc).__name__}: {exc}"
    load_shards(previous, {"emb": emb})
    return {"error": error, "loaded": checkpoint(emb)}


def load_repeatedly(name: str, directory: str, times: int) -> dict:
    """Load the checkpoint in ``directory`` ``times`` times into table ``name`` on ps0-ps2 (which
    another trainer loads at the same time): the errors and the table's checkpoint."""
    from remote_module.ps import load_shards

    emb = bag(name, ["ps0", "ps1", "ps2"], "eager-sgd", num_trainers=2)
    errors = []
    for _ in range(times):
        try:
            load_shards(directory, {"emb": emb})
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            errors.append(f"{type(exc).__name__}: {exc}")
    return {"errors": errors, "after": checkpoint(emb)}


def eager_then_lazy(name: str, directory: str) -> dict:
    """An eager table saved, then a lazy one saved over it in the same directory: the files."""
    from remote_module.ps import save_shards

    eager = bag(name + "-eager", ["ps0", "ps1"], "eager-sgd")
    train(eager, range(2))
    save_shards(directory, {"emb": eager})
    lazy = bag(name + "-lazy", ["ps0", "ps1"], "lazy-adagrad-admission-eviction")
    train(lazy, range(2))
    save_shards(directory, {"emb": lazy})
    return {"files": sorted(os.listdir(directory))}


def job_checkpointed(name: str, directory: str) -> dict:
    """A table on ps0, ps1 trained 4 steps under a ``Checkpointer`` saving every 2 (this trainer
    the job's only one): the table's checkpoint at each save, by step."""
    import torch.distributed.rpc as rpc

    from remote_module.ps import Checkpointer

    emb = bag(name, ["ps0", "ps1"], "eager-sgd")
    ckpt = Checkpointer(directory, every_steps=2, keep=3, ps={"emb": emb}, trainers=["trainer0"])
    held = {}
    for k in range(ckpt.resume(), 4):
        train(emb, range(k, k + 1))
        if ckpt.step() is not None:
            held[ckpt.step_index] = checkpoint(emb)
    ckpt.close()
    # (the servers kept the last save's snapshot memory for the next; close() freed it)
    held["kept after close"] = {server: rpc.rpc_sync(server, kept_bytes, args=(name,)) for server in ("ps0", "ps1")}
    return held


def job_resumed(name: str, directory: str) -> dict:
    """A fresh table (another name: other initial rows) resumed by a ``Checkpointer`` from
    ``directory``: the step it resumed from, the warnings said, and the table's checkpoint."""
    import warnings

    from remote_module.ps import Checkpointer

    emb = bag(name, ["ps0", "ps1"], "eager-sgd")
    ckpt = Checkpointer(directory, every_steps=2, keep=3, ps={"emb": emb}, trainers=["trainer0"])
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        start = ckpt.resume()
    return {"start": start, "warnings": [str(w.message) for w in said], "table": checkpoint(emb)}


# ---- saves in the background: the servers' writers held on a gate --------------------------------

_gate = threading.Event()


def _held_until_released(seconds: float) -> None:
    _gate.wait(seconds)


def hold_writer(seconds: float) -> None:
    """(On a server) queue a task on this server's background writer that waits for
    :func:`release_writer` (at most ``seconds``): the background writes queued after it wait."""
    from remote_module.ps._shard_io import writes

    _gate.clear()
    key = ("test-hold", time.monotonic())
    writes.begin(key, partial(_held_until_released, seconds), "a test's hold")
    writes.outcome(key, "a test's hold")  # (not kept: nobody asks for it)


def release_writer() -> None:
    _gate.set()


def saved_in_the_background(name: str, directory: str, hold_s: float) -> dict:
    """A table on ps0, ps1 trained 6 steps; a background save begun with both servers' writers
    held; 6 more steps trained; the writers released and the save waited for; then loaded into
    a fresh table. The table's checkpoint at the save, at the end of training and as loaded,
    and whether the save said done while held."""
    import torch.distributed.rpc as rpc

    from remote_module.ps import load_shards
    from remote_module.ps.checkpoint._shards import begin_save_shards

    source = bag(name, ["ps0", "ps1"], "lazy-adagrad-admission-eviction")
    train(source, range(6))
    at_save = checkpoint(source)
    for server in ("ps0", "ps1"):
        rpc.rpc_sync(server, hold_writer, args=(hold_s,))
    began = begin_save_shards(directory, {"emb": source})
    train(source, range(6, 12))  # (the servers' tables change while their snapshot waits to be written)
    trained_on = checkpoint(source)
    done_while_held = began.done()
    torn_while_held = os.path.exists(os.path.join(directory, "manifest.json"))
    for server in ("ps0", "ps1"):
        rpc.rpc_sync(server, release_writer)
    manifest = began.wait()
    loaded = bag(name + "-loaded", ["ps0", "ps1"], "lazy-adagrad-admission-eviction")
    load_shards(directory, {"emb": loaded})
    return {"at_save": at_save, "trained_on": trained_on, "loaded": checkpoint(loaded), "manifest": manifest,
            "done_while_held": done_while_held, "torn_while_held": torn_while_held}


def kept_bytes(table: str) -> int:
    """(On a server) bytes of snapshot memory kept for the next save of ``table``."""
    from remote_module.ps._shard_io import snapshots

    return snapshots.held_bytes(lambda key: key[1] == table)


def saves_into_kept_memory(name: str, first: str, second: str, hold_s: float) -> dict:
    """An eager table on ps0, ps1 (SparseAdam, eviction clocks) saved twice with its servers
    keeping the snapshot memory: the first save begun with both writers held, the second begun
    while the first still waits to be written (its snapshot must not reuse memory not yet
    written), the table trained between and after; then a third save once both are written (its
    snapshot reuses the kept memory). Each checkpoint loaded into a fresh table, beside the table
    at each save, and the servers' kept bytes after the first two saves."""
    import torch.distributed.rpc as rpc

    from remote_module.ps import load_shards
    from remote_module.ps.checkpoint._shards import begin_save_shards, release_snapshot_memory

    case = "eager-sparse-adam-eviction"
    source = bag(name, ["ps0", "ps1"], case)
    train(source, range(4))
    at = [checkpoint(source)]
    for server in ("ps0", "ps1"):
        rpc.rpc_sync(server, hold_writer, args=(hold_s,))
    saves = [begin_save_shards(first, {"emb": source}, keep_snapshot_s=hold_s)]
    train(source, range(4, 7))
    at.append(checkpoint(source))
    saves.append(begin_save_shards(second, {"emb": source}, keep_snapshot_s=hold_s))
    train(source, range(7, 10))
    for server in ("ps0", "ps1"):
        rpc.rpc_sync(server, release_writer)
    for save in saves:
        save.wait()
    kept = {server: rpc.rpc_sync(server, kept_bytes, args=(name,)) for server in ("ps0", "ps1")}
    at.append(checkpoint(source))
    third = os.path.join(os.path.dirname(second), "third")
    begin_save_shards(third, {"emb": source}, keep_snapshot_s=hold_s).wait()
    train(source, range(10, 12))
    loaded = []
    for i, directory in enumerate((first, second, third)):
        into = bag(f"{name}-loaded{i}", ["ps0", "ps1"], case)
        load_shards(directory, {"emb": into})
        loaded.append(checkpoint(into))
    release_snapshot_memory({"emb": source})
    released = {server: rpc.rpc_sync(server, kept_bytes, args=(name,)) for server in ("ps0", "ps1")}
    return {"at": at, "loaded": loaded, "kept": kept, "released": released}


def copied_into_kept_memory() -> dict:
    """(On a server) its snapshot copies into kept memory so far: of changed rows only, or whole."""
    from remote_module.ps._shard_io import snapshots

    return dict(snapshots.copied)


def saves_of_few_changed_rows(name: str, directory: str) -> dict:
    """An eager table on ps0, ps1 saved three times with its servers keeping the snapshot
    memory, one step touching two rows between saves (the later snapshots copy only those into
    the kept memory): each save loaded into a fresh table beside the table at each save, and the
    servers' copies into kept memory (partial, whole) during the saves (the table's
    ``state_dict()`` read between them, as ``checkpoint()`` does, leaves that memory alone)."""
    import torch.distributed.rpc as rpc

    from remote_module.ps import load_shards
    from remote_module.ps.checkpoint._shards import begin_save_shards, release_snapshot_memory

    source = bag(name, ["ps0", "ps1"], "eager-sgd")
    train(source, range(3))
    before = {server: rpc.rpc_sync(server, copied_into_kept_memory) for server in ("ps0", "ps1")}
    at, saves = [], [os.path.join(directory, f"s{i}") for i in range(3)]
    for i, path in enumerate(saves):
        if i:
            train(source, range(10 + i, 11 + i), among=torch.tensor([5 + i, 44 - i]))
        at.append(checkpoint(source))
        begin_save_shards(path, {"emb": source}, keep_snapshot_s=60).wait()
    copied = {server: {k: v - before[server][k] for k, v in rpc.rpc_sync(server, copied_into_kept_memory).items()}
              for server in ("ps0", "ps1")}
    release_snapshot_memory({"emb": source})
    loaded = []
    for i, path in enumerate(saves):
        into = bag(f"{name}-loaded{i}", ["ps0", "ps1"], "eager-sgd")
        load_shards(path, {"emb": into})
        loaded.append(checkpoint(into))
    return {"at": at, "loaded": loaded, "copied": copied}


def failed_background_write(name: str, directory: str) -> str | None:
    """A background save in the local layout whose ps1 folder cannot be made (a file is in its
    place): the error its ``wait()`` raises, or None."""
    from remote_module.ps.checkpoint._shards import begin_save_shards

    emb = bag(name, ["ps0", "ps1"], "eager-sgd")
    train(emb, range(2))
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "ps1"), "w") as f:
        f.write("not a folder")
    began = begin_save_shards(directory, {"emb": emb}, layout="local")
    try:
        began.wait()
    except Exception as exc:  # noqa: BLE001 - the outcome under test
        return f"{type(exc).__name__}: {exc}"
    return None


def two_saves_into_one_directory(name: str, directory: str) -> dict:
    """Two background saves of one table into ``directory``, the second begun before the first
    is waited for: what each ``wait()`` does, and whether the second's checkpoint loads."""
    from remote_module.ps import load_shards
    from remote_module.ps.checkpoint._shards import begin_save_shards

    emb = bag(name, ["ps0", "ps1"], "eager-sgd")
    train(emb, range(2))
    first = begin_save_shards(directory, {"emb": emb})
    train(emb, range(2, 4))
    second = begin_save_shards(directory, {"emb": emb})
    out = {}
    for what, began in (("first", first), ("second", second)):
        try:
            began.wait()
            out[what] = None
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            out[what] = f"{type(exc).__name__}: {exc}"
    at_second = checkpoint(emb)
    loaded = bag(name + "-loaded", ["ps0", "ps1"], "eager-sgd")
    load_shards(directory, {"emb": loaded})
    out["same"] = all(torch.equal(a, b) for a, b in zip(checkpoint(loaded)["model"].values(),
                                                         at_second["model"].values()) if isinstance(a, torch.Tensor))
    return out
