"""Shard checkpoints of sharded tables and PSModels: each server writes and reads its own blocks
(``tables/server/_shard_files.py``, ``dense/_shard_files.py``); the trainer writes only a small
manifest and its own small files, and reads only them.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import pickle
import time
import uuid
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple

import torch
from torch import nn
from torch.futures import collect_all

from remote_module._core import call_all, call_all_async, nested_seconds, wait_plain
from remote_module.ps._shard_io import save_bytes, write_file
from remote_module.ps.checkpoint._manifest import (
    DCP_METADATA,
    FORMAT,
    LAYOUTS,
    MANIFEST,
    SAVE_ID,
    SELF_SHA256,
    VERSION,
    CheckpointError,
    dcp_metadata,
    file_entry,
    file_record,
    overlaps,
    read_chain,
    read_manifest,
    sync_directory,
    table_entry,
    write_atomically,
    write_manifest,
)
from remote_module.ps.dense import _shard_files as _model_files
from remote_module.ps.dense._model import PSModel
from remote_module.ps.tables._collection import ShardedEmbeddingBagCollection
from remote_module.ps.tables._embedding import ShardedEmbedding
from remote_module.ps.tables.server import _shard_files
from remote_module.ps.tables.server._shard_files import FileEntry, ShardReads


def _tables_of(objects: Any) -> tuple[list[tuple[str, ShardedEmbedding]], dict]:
    """The tables of ``objects`` by state_dict-style key (``"emb"``, a collection's
    ``"ebc.a"``) and what the manifest says of each object; ``TypeError`` for anything else."""
    if not isinstance(objects, Mapping):
        raise TypeError(f"objects must map names to tables, e.g. {{'emb': table}}, got {type(objects).__name__}")
    tables, described = [], {}
    for name, obj in objects.items():
        if not isinstance(name, str) or not name or name.startswith(".") or "/" in name or os.sep in name:
            raise ValueError(f"object names must be non-empty and usable in file names (no '/', not starting "
                             f"with '.'), got {name!r}")
        if isinstance(obj, ShardedEmbedding):
            tables.append((name, obj))
            described[name] = {"kind": "table"}
        elif isinstance(obj, ShardedEmbeddingBagCollection):
            tables += [(f"{name}.{t}", table) for t, table in obj.tables().items()]
            described[name] = {"kind": "collection", "tables": list(obj.tables())}
        elif isinstance(obj, PSModel):  # (its dense blocks: _models_of; the tables inside it as tables)
            tables += [(f"{name}.{t}", table) for t, table in obj._tables.items()]
            described[name] = {"kind": "model", "tables": list(obj._tables)}
        else:
            raise TypeError(f"save_shards / load_shards take ShardedEmbedding, ShardedEmbeddingBag, "
                            f"ShardedEmbeddingBagCollection and PSModel objects; {name!r} is {type(obj).__name__}")
    keys = [key for key, _ in tables]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        raise ValueError(f"two tables would be saved as {twice[0]!r} (a collection's table is "
                         "'<name>.<table>'): give the objects names that do not collide")
    names = [table.name for _, table in tables]  # (two objects of one name are one table on its servers)
    again = sorted({n for n in names if names.count(n) > 1})
    if again:
        under = [key for key, table in tables if table.name == again[0]]
        raise ValueError(f"table {again[0]!r} is given twice ({', '.join(map(repr, under))}): each table "
                         "saves and loads once, under one name")
    return tables, described


def _timeout(tables: list[tuple[str, Any]]) -> float | None:
    """The longest timeout of the tables (or PSModels) given; None if one has none."""
    timeouts = [t.timeout for _, t in tables]
    return None if not timeouts or any(t is None for t in timeouts) else max(timeouts)


def save_shards(path: str | os.PathLike, objects: Mapping[str, Any], *, layout: str = "shared",
                token: str | None = None, base: str | os.PathLike | None = None) -> dict:
    """Save sharded tables and PSModels to the directory ``path``, each server writing its own blocks.

    ``objects`` maps a name (a state_dict prefix) to a table, a collection or a ``PSModel``.
    Every server of every table writes its blocks there itself, concurrently and without
    waiting for another, and so does every dense server of a PSModel (its blocks' values and
    optimizer state: ``<name>.<server>.pt``; the tables inside a PSModel are saved as tables,
    ``<name>.<table>``); then the trainer writes its own small files (``<name>.trainer.pt``: its
    ``ps_optimizer`` settings; a PSModel's buffers and the optimizer state that is not per
    element; geo: its own optimizer state) and ``manifest.json`` (every file's size and checksum),
    last and atomically: a directory without it is torn and never loaded. The tables are
    settled first, as ``state_dict()`` settles them (a PSModel's pushes land, half_async
    merges, sync reads after this trainer's last step). Returns the manifest.

    ``layout``: ``"shared"`` (``path``, made absolute here, is one directory every server and
    the trainer reach at that path, a shared filesystem or one machine): loads onto any
    servers, any number (2 -> 3).
    ``"local"``: each server writes under ``path/<its worker name>/`` on its own disk (the
    trainer's files and manifest stay in ``path`` on its own); it loads only onto the same
    servers holding the same blocks (:class:`CheckpointError` otherwise: use ``"shared"``).

    An eager table's weight is also a ``torch.distributed.checkpoint`` checkpoint: in a plain
    process (no process group), ``dcp.load({"<name>.weight": torch.empty(N, D)},
    checkpoint_id=path)`` reads it (``"<name>.<table>.weight"`` for a collection's table; in
    the local layout once the servers' folders are gathered under ``path``). Lazy tables'
    rows and every table's optimizer state are by id (``torch.save``) beside them.

    Incremental saves: a save with a ``token`` names a chain (each table's servers keep, from
    then on, the ids they drop, for the next save of the chain); one with ``base`` as well (a
    complete save of the same ``token`` and layout, its directory) writes of each table only
    the rows changed since the base on each server, their optimizer state and the ids dropped
    since, by id, beside a whole copy of everything else (PSModels, sketches, the trainer's
    files). Its manifest names the base (its path relative to ``path``, and its manifest's
    checksum), and a load reads the base (and its own base, down to a full save) and then the
    incremental saves in order, with the same result as loading a full save taken at the end.
    So the base must stay where it is, as saved: a load refuses a broken chain naming the
    missing link. A server that cannot tell what changed since the base (it was restarted, its
    blocks moved, or it dropped more ids than it keeps, ``Tombstones.KEPT``) writes its blocks
    whole; a save where every server did so names no base. ``dcp.load`` reads full saves only
    (an incremental save writes no ``.metadata``). The ``Checkpointer`` (``full_every=``)
    makes such chains itself.

    Example (the trainer; servers ``ps0``, ``ps1`` run no code of their own)::

        emb = ShardedEmbeddingBag(10**6, 16, ["ps0", "ps1"], name="emb", init="lazy")
        model = PSModel(nn.Linear(16, 1), ["ps0", "ps1"], name="head", num_trainers=1)
        ...  # training
        manifest = save_shards("/shared/ckpt/step100", {"emb": emb, "model": model})
        load_shards("/shared/ckpt/step100", {"emb": emb, "model": model})
    """
    return begin_save_shards(path, objects, layout=layout, token=token, base=base).wait()


class ShardSave:
    """A :func:`save_shards` begun by :func:`begin_save_shards`: the servers have taken their
    snapshot and write it in the background. :meth:`done` says whether every server has
    written; :meth:`wait` waits for them and writes the trainer's files and the manifest (the
    checkpoint is complete from then on). Until then the directory is torn: no load reads it."""

    def __init__(self, directory: str, layout: str, tables: list, described: dict, owns: list[memoryview],
                 written: Any, models: _ModelsBegun | None, save: str, chain: dict | None = None) -> None:
        self.directory, self.layout, self._tables, self._described = directory, layout, tables, described
        self._save, self._chain = save, chain or {}
        self._owns, self._written, self._models = owns, written, models
        self._manifest: dict | None = None
        #: seconds from the snapshot to the last server's files written (None until then)
        self.write_s: float | None = None
        began = time.perf_counter()

        def finished(_: Any) -> None:
            self.write_s = time.perf_counter() - began

        self._all = written if models is None else collect_all([written, models.written])
        self._all.add_done_callback(finished)

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once every server has written (or one failed), on the thread that
        saw it (an RPC thread: keep it short)."""
        self._all.add_done_callback(lambda _: callback())

    def done(self) -> bool:
        """Whether every server has written its files (or one failed: :meth:`wait` raises it)."""
        return self._manifest is not None or self._all.done()

    def wait(self) -> dict:
        """Wait for every server's files (at most the timeout :func:`begin_save_shards` was
        given), then write the trainer's files of the tables and the manifest, last and
        atomically; returns the manifest. Raises what failed (a server lost, a write that
        failed, naming the files), leaving the directory torn."""
        if self._manifest is not None:
            return self._manifest
        got = iter(wait_plain(self._written))
        try:
            with open(os.path.join(self.directory, SAVE_ID), "rb") as f:
                latest = f.read().decode()
        except OSError:
            latest = None
        if latest != self._save:
            raise CheckpointError(f"{self.directory}: another save into this directory began while this one was "
                                  "written (their servers write the same files): this one is refused, no manifest "
                                  "written; save each checkpoint into a directory of its own")
        manifest: dict[str, Any] = {"format": FORMAT, "version": VERSION, "layout": self.layout,
                                    "objects": self._described, "tables": {}, "files": {},
                                    "token": self._chain.get("token"), "base": None}
        weights = {}
        for (key, table), own in zip(self._tables, self._owns):
            entry = _table_manifest(self.directory, self.layout, key, table,
                                    [(s, next(got)) for s in table._by_server], own, manifest["files"])
            manifest["tables"][key] = entry
            if entry["incremental"]:  # (a load reads its base first)
                manifest["base"] = self._chain["base"]
            if entry["dcp_key"] is not None:
                weights[entry["dcp_key"]] = ((table.num_embeddings, table.embedding_dim), [
                    (part["weights"], *chunk) for part in entry["servers"].values() for chunk in part["chunks"]])
        manifest["models"] = ({} if self._models is None else
                              _models_manifest(self.directory, self.layout, self._models, manifest["files"]))
        if self.layout == "shared":
            _check_visible(self.directory, manifest["files"])
        if weights:
            size, checksum = _shard_files._write_file(self.directory, DCP_METADATA,
                                                      [memoryview(dcp_metadata(weights))])
            manifest["files"][DCP_METADATA] = file_record(size, checksum, None)
        os.remove(os.path.join(self.directory, SAVE_ID))  # (a save under way no more)
        self._manifest = write_manifest(self.directory, manifest)
        return self._manifest


def _check_visible(directory: str, files: dict) -> None:
    """``CheckpointError`` (the checkpoint stays torn) naming a server's file that the trainer
    does not see in ``directory`` at the size the server wrote: the shared layout needs one
    directory that every server and the trainer reach at that path (not each machine's own
    disk: use ``layout="local"`` there)."""
    for rel, entry in files.items():
        if entry["server"] is None:
            continue
        path = os.path.join(directory, rel)
        try:
            size = os.path.getsize(path)
        except OSError:
            size = None
        if size != entry["bytes"]:
            seen = "is not there" if size is None else f"has {size} bytes, not {entry['bytes']}"
            raise CheckpointError(
                f"{path}: {entry['server']} wrote it, but this trainer's view of {directory} {seen}; "
                "layout='shared' needs one directory every server and the trainer reach at the same path (a "
                "shared filesystem); with each machine's own disk, save with layout='local'. No manifest was "
                "written: this checkpoint is torn and never loaded")


def begin_save_shards(path: str | os.PathLike, objects: Mapping[str, Any], *, layout: str = "shared",
                      timeout: float | None = None, keep_snapshot_s: float = 0.0, token: str | None = None,
                      base: str | os.PathLike | None = None) -> ShardSave:
    """:func:`save_shards` in the background: returns once every server has taken a snapshot
    of its blocks (the tables are settled first, as for ``save_shards``), while they write it;
    training may go on at once without changing what is saved. ``ShardSave.wait()`` completes
    the checkpoint (the manifest, last). ``timeout``: seconds the servers' writing may take,
    counted from now (default: the tables' timeout); each server writes one save after another,
    so a save begun before the last one was written waits for it within that time (the
    ``Checkpointer`` begins a save only once the one before is complete). A save begun into a
    directory while another one is written there refuses the earlier one (its ``wait()`` raises
    ``CheckpointError``): save each checkpoint into a directory of its own.
    ``keep_snapshot_s``: for a job that saves again within that many seconds (the
    ``Checkpointer``), each table server keeps the memory of its eager rows' snapshot that long
    and copies the next snapshot into it (a memcpy instead of page faults: less CPU on the
    server and a shorter wait here); meanwhile the server holds that memory (as much as its
    eager rows) between saves too. 0: each snapshot in fresh memory, freed once written.
    ``token``, ``base``: an incremental save (see :func:`save_shards`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not 0 <= keep_snapshot_s < math.inf:  # (a server's timer cannot wait forever: it would keep it for good)
        raise ValueError(f"keep_snapshot_s must be a finite number of seconds, 0 or more, got {keep_snapshot_s!r}")
    directory = os.path.abspath(os.fspath(path))  # (servers resolve it the same, whatever their cwd)
    tables, described = _tables_of(objects)
    models = _models_of(objects)
    chain, bases = _chain_of(directory, layout, tables, token, base)
    os.makedirs(directory, exist_ok=True)
    # saved over: torn until the new manifest, and no reader of torch's format (dcp.load) reads
    # the old eager weights either: the metadata is written again just before the manifest
    removed = False
    for stale in (MANIFEST, DCP_METADATA):
        if os.path.exists(os.path.join(directory, stale)):
            os.remove(os.path.join(directory, stale))
            removed = True
    if removed:
        sync_directory(directory)
    _settle_models(models)
    for _, table in tables:
        table._settle()
    save = uuid.uuid4().hex
    # this save's id: a save begun into this directory since (whose servers write over these
    # files) makes this one's wait() refuse to write a manifest (not flushed to disk: it matters only while
    # this save runs, and a crash leaves the save torn whatever it holds)
    write_atomically(os.path.join(directory, SAVE_ID), save.encode(), durable=False)
    each: dict[str, list[tuple[str, str, str, bool]]] = {}  # (one call per server: its snapshots one by one)
    for key, table in tables:
        for server in table._by_server:
            each.setdefault(server, []).append((table.name, directory if layout == "shared" else
                                                os.path.join(directory, server), f"{key}.{server}",
                                                table.evict_after_steps is not None))
    call_all([(server, _shard_files._begin_shards, (save, mine, keep_snapshot_s, token, bases.get(server)))
              for server, mine in each.items()], timeout=_timeout(tables))
    # PSModels: their servers copy their blocks at the same point, then write them in the background
    models_begun = _begin_models(directory, layout, models, save, timeout) if models else None
    # the trainer's own state of each table (geo: its local optimizer's) as of the snapshot,
    # serialized now (a copy), written at wait()
    owns = [save_bytes({"ps_optimizer": table.ps_optimizer.state_dict(),
                         "geo": table.optimizer_state_dict() if table.ps_mode == "geo" else None})
            for _, table in tables]
    written = call_all_async([(server, _shard_files._shards_written, (table.name, save))
                              for _, table in tables for server in table._by_server],
                             timeout=_timeout(tables) if timeout is None else timeout)
    return ShardSave(directory, layout, tables, described, owns, written, models_begun, save, chain)


def _chain_of(directory: str, layout: str, tables: list, token: str | None,
              base: str | os.PathLike | None) -> tuple[dict, dict]:
    """An incremental save's place (checked before anything changes): ``{"token", "base"}``
    for its manifest, and by server, by table name, ``(version, incarnation, blocks)`` of the
    base's part there (what the server saves the changes since)."""
    if token is not None and (not isinstance(token, str) or not token):
        raise ValueError(f"token must be a non-empty str naming a chain of saves, got {token!r}")
    if base is None:
        return {"token": token}, {}
    if token is None:
        raise ValueError("an incremental save (base=...) needs the token its base was saved with: the servers keep "
                         "the ids they drop only for a chain that a token names")
    where = os.path.abspath(os.fspath(base))
    if os.path.realpath(where) == os.path.realpath(directory):  # (through a symlink too)
        raise ValueError(f"base is the directory saved into, {directory!r}: an incremental save goes into a "
                         "directory of its own")
    saved = read_manifest(where)
    try:
        links = read_chain(where, saved)
    except CheckpointError as exc:
        raise CheckpointError(f"base {where} does not load, so neither would a save on it: {exc}") from None
    if os.path.realpath(directory) in (os.path.realpath(at) for at, _ in links):
        raise ValueError(f"base {where} is an incremental save on {directory}, the directory saved into: saving "
                         "there would break the chain it is on")
    if saved.get("token") != token:
        raise ValueError(f"{where} was saved with token {saved.get('token')!r}, not {token!r}: an incremental save "
                         "follows a save of its own chain (its servers kept the dropped ids for that one)")
    if saved["layout"] != layout:
        raise ValueError(f"{where} is in the {saved['layout']!r} layout: an incremental save on it is too, not "
                         f"layout={layout!r}")
    bases: dict[str, dict] = {}
    for key, table in tables:
        entry = saved["tables"].get(key)
        if entry is None or entry["name"] != table.name:  # (not in the base: saved whole)
            continue
        for server, part in entry["servers"].items():
            if server in table._by_server and part.get("incarnation"):
                bases.setdefault(server, {})[table.name] = (int(part["versions"][0]), part["incarnation"],
                                                            [tuple(b) for b in part["blocks"]])
    return {"token": token, "base": {"path": os.path.relpath(where, directory),
                                     "manifest_sha256": saved[SELF_SHA256]}}, bases


def release_snapshot_memory(objects: Mapping[str, Any], timeout: float | None = None) -> None:
    """Have the servers of ``objects``' tables free the snapshot memory they keep for the next
    save (``begin_save_shards(keep_snapshot_s=...)``) now rather than when it expires: the job
    saves no more (the ``Checkpointer``'s ``close()``). A server that does not answer within
    ``timeout`` (lost) is skipped: its memory goes with it."""
    _tell_servers(objects, _shard_files._forget_snapshots, (), timeout)


def end_save_chain(objects: Mapping[str, Any], token: str, timeout: float | None = None) -> None:
    """Have the servers of ``objects``' tables stop keeping the ids they drop for the
    incremental saves of ``token`` (``save_shards(token=...)``): no save of that chain follows
    (the ``Checkpointer``'s ``close()`` calls it for its own). A save of it after this is written
    whole where ids were dropped since its base. A server that does not answer within
    ``timeout`` is skipped (the ids kept are bounded: ``Tombstones.KEPT``).

    Example::

        save_shards("/shared/ckpt/a", {"emb": emb}, token="nightly")
        save_shards("/shared/ckpt/b", {"emb": emb}, token="nightly", base="/shared/ckpt/a")
        end_save_chain({"emb": emb}, "nightly")  # (the servers keep no dropped ids for it any more)
    """
    _tell_servers(objects, _shard_files._end_chain, (token,), timeout)


def _tell_servers(objects: Mapping[str, Any], handler: Callable, args: tuple, timeout: float | None) -> None:
    """Call ``handler(names, *args)`` once on every server of ``objects``' tables (``names``:
    its tables'), best effort: a server that fails or does not answer within ``timeout`` is
    skipped."""
    tables, _ = _tables_of(objects)
    names: dict[str, list[str]] = {}
    for _, table in tables:
        for server in table._by_server:
            names.setdefault(server, []).append(table.name)
    if not names:
        return
    try:
        call_all([(server, handler, (mine, *args)) for server, mine in names.items()],
                 timeout=_timeout(tables) if timeout is None else timeout)
    except Exception:  # (best effort: what a lost server held goes with it)
        pass


def _table_manifest(directory: str, layout: str, key: str, table: ShardedEmbedding, written: list, own: memoryview,
                    files: dict) -> dict:
    """A table's manifest entry, from what each server wrote (``written``: ``(server, Written)``)
    and the trainer's ``own`` state of it (its ps_optimizer settings; in geo mode its local
    optimizer state; serialized), which it writes here; adds every file to ``files``."""
    servers = {}
    for server, reply in written:
        where = "" if layout == "shared" else f"{server}/"
        for rel, (size, checksum) in reply.files.items():
            files[where + rel] = file_record(size, checksum, server)
        stem = f"{where}{key}.{server}"
        servers[server] = {**{k: v for k, v in reply._asdict().items() if k != "files"}, "rows": f"{stem}.pt",
                           "weights": f"{stem}.distcp" if reply.chunks else None,
                           "sketch": f"{stem}.sketch.pt" if f"{key}.{server}.sketch.pt" in reply.files else None}
    rel = f"{key}.trainer.pt"
    files[rel] = file_record(*_shard_files._write_file(directory, rel, [own]), None)
    incremental = any(p["since"] is not None for p in servers.values())
    return {**table_entry(table), "clock": max(p["clock"] for p in servers.values()),
            "optimizer_steps": max(p["optimizer_steps"] for p in servers.values()), "trainer_file": rel,
            "dcp_key": f"{key}.weight" if table.init != "lazy" and not incremental else None, "servers": servers,
            "incremental": incremental}


def load_shards(path: str | os.PathLike, objects: Mapping[str, Any]) -> None:
    """Load what :func:`save_shards` saved in ``path`` into ``objects`` (the same names), each
    server reading its own blocks itself.

    The trainer reads the manifest and checks, before anything changes, that each table fits
    (sizes, optimizer, admission sketch: the checks of ``load_state_dict`` and
    ``load_optimizer_state_dict``), that each PSModel fits (parameter names and shapes, buffers,
    optimizer class, geo or not) and that the layout can be read here. Then every server reads
    the files that hold rows (elements) of its blocks, checking each one's size and checksum; only
    when every server has read its files do they load them, as ``load_state_dict()`` then
    ``load_optimizer_state_dict()`` of the same tables and PSModels would (bit for bit; a
    PSModel's local parameters show the values loaded from its next forward's pull on). A
    shared-layout checkpoint loads onto any number of servers (re-sliced); a local one only onto
    the servers that saved it, holding the same blocks.

    :class:`CheckpointError` (nothing loaded) for a torn checkpoint (no manifest), a file
    missing, truncated or corrupt (named), or a layout these servers cannot read; ``ValueError``
    for a table or PSModel that does not fit; ``TypeError`` for other objects. (A server lost
    after every server checked its files, while they load them, leaves the objects partly
    loaded: load again.)

    Example (the trainer; the servers run no code of their own)::

        emb = ShardedEmbeddingBag(10**6, 16, ["ps0", "ps1", "ps2"], name="emb", init="lazy")
        load_shards("/shared/ckpt/step100", {"emb": emb})  # saved on ps0, ps1: now on three
    """
    directory = os.path.abspath(os.fspath(path))  # (servers resolve it the same, whatever their cwd)
    manifest = read_manifest(directory)
    tables, _ = _tables_of(objects)
    models = _models_of(objects)
    links = read_chain(directory, manifest)  # (itself alone unless an incremental save)
    plans = [_plan(links, key, table) for key, table in tables]
    model_plans = [_model_plan(directory, manifest, key, model) for key, model in models]
    load = uuid.uuid4().hex
    timeout = _timeout(tables + models)
    stage = [(server, _shard_files._stage_chain, (table.name, load, reads, plan["clock"], timeout))
             for (_, table), plan in zip(tables, plans) for server, reads in plan["reads"].items()]
    drop = [(server, _shard_files._drop_staged, (name, load)) for server, _, (name, *_) in stage]
    model_stage, model_drop, model_apply = _model_calls(directory, load, model_plans, timeout)
    try:
        refused = sorted({why for why in call_all(stage + model_stage, timeout=timeout) if why is not None})
    except BaseException:  # (a server lost or timed out: the others' staged rows are dropped, as can be)
        with contextlib.suppress(Exception):
            call_all(drop + model_drop, timeout=timeout)
        raise
    if refused:
        call_all(drop + model_drop, timeout=timeout)
        raise CheckpointError(f"the checkpoint in {directory!r} cannot be loaded, nothing was: " + "; ".join(refused))
    for _, table in tables:
        table._before_rows_change()
    call_all([(server, _shard_files._apply_staged, (table.name, load, plan["apply_clock"], plan["optimizer_steps"]))
              for (_, table), plan in zip(tables, plans) for server in plan["reads"]] + model_apply, timeout=timeout)
    for (_, table), plan in zip(tables, plans):
        table._loaded_from_files(plan["place"], plan["own"]["ps_optimizer"], plan["own"]["geo"])
    _models_loaded(models, model_plans)


def _own_state(directory: str, files: dict, rel: str) -> dict:
    """The trainer's file of a table (its ps_optimizer settings, geo state), checked."""
    try:
        _shard_files._verify(directory, FileEntry(*file_entry(files, rel)))
        return torch.load(os.path.join(directory, rel), weights_only=True)
    except CheckpointError:
        raise
    except (ValueError, OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
        raise CheckpointError(f"the checkpoint in {directory!r} cannot be loaded, nothing was: {exc}") from None


def _check_fits(key: str, entry: dict, table: ShardedEmbedding, own: dict) -> None:
    """``ValueError`` (nothing changed) unless the saved table ``entry`` fits ``table``: the
    checks of ``load_state_dict`` and ``load_optimizer_state_dict``."""
    shape, mine = (entry["num_embeddings"], entry["embedding_dim"]), (table.num_embeddings, table.embedding_dim)
    if shape != mine:
        raise ValueError(f"size mismatch for {key}.weight: the checkpoint's table is {shape}, this one {mine}")
    if entry["init"] != table.init or (entry["ps_mode"] == "geo") != (table.ps_mode == "geo"):
        raise ValueError(f"{key}: the checkpoint's table is init={entry['init']!r}, ps_mode={entry['ps_mode']!r}; this "
                         f"one init={table.init!r}, ps_mode={table.ps_mode!r}: load into a table of the same init "
                         "(and geo or not, as saved), or go through state_dict()")
    parts = [(None, torch.empty(entry["admit_sketch_bytes"] or 0, dtype=torch.uint8, device="meta"))
             for part in entry["servers"].values() if part["sketch"] is not None]
    refused = table._admission_misfit(parts, entry["admission_bits"])
    if refused:
        raise ValueError(f"admission sketch of {key}: {refused}")
    if own["geo"] is not None:
        table._check_optimizer_state(own["geo"])
        return
    keys = list(dict.fromkeys(k for part in entry["servers"].values() for k in part["state_keys"]))
    table._check_optimizer(keys, own["ps_optimizer"], "optimizer state",
                           any(part["state_rows"] for part in entry["servers"].values()))


def _check_layout(directory: str, manifest: dict, key: str, entry: dict, table: ShardedEmbedding) -> None:
    """``CheckpointError`` unless ``table``'s servers can read the checkpoint: a local layout's
    servers must be the saving ones, holding the same blocks (each reads only its own folder)."""
    if manifest["layout"] == "shared":
        return
    saved = {s: sorted(tuple(b) for b in p["blocks"]) for s, p in entry["servers"].items()}
    mine = {s: sorted(tuple(b) for b in blocks) for s, blocks in table._by_server.items()}
    if saved != mine:
        raise CheckpointError(
            f"{os.path.join(directory, MANIFEST)}: table {key!r} was saved in the local layout (each server under "
            f"{directory}/<server>/ on its own disk) by servers {sorted(saved)} holding blocks {saved}; this table's "
            f"servers hold {mine}. A local checkpoint loads only onto the same servers holding the same blocks: "
            "save with layout='shared' (a directory every server reads) to load onto other servers")


def _reads(entry: dict, files: dict, server: str, blocks: list, layout: str, sketches: bool,
           clocks: dict | None = None) -> ShardReads:
    """What ``server`` (holding ``blocks``) reads of a table's checkpoint ``entry``. ``clocks``:
    by saving server, the step its rows' eviction clocks count from, where not the entry's
    (a base of an incremental save: the last save's; the server's clock went on since)."""
    reads = ShardReads([], [], [], [])
    for saver, part in entry["servers"].items():
        if not (saver == server if layout == "local" else overlaps(part["blocks"], blocks)):
            continue
        reads.files.append(FileEntry(*file_entry(files, part["rows"])))
        reads.rows.append((part["rows"], int((clocks or {}).get(saver, part["clock"]))))
        if part["weights"] is not None:
            reads.files.append(FileEntry(*file_entry(files, part["weights"])))
            reads.chunks.extend((part["weights"], *chunk) for chunk in part["chunks"])
    for saver, part in entry["servers"].items():
        if sketches and part["sketch"] is not None and (layout == "shared" or saver == server):
            reads.files.append(FileEntry(*file_entry(files, part["sketch"])))
            reads.sketches.append(part["sketch"])
    return reads


def _plan(links: list[tuple[str, dict]], key: str, table: ShardedEmbedding) -> dict:
    """How ``table`` loads the checkpoint's ``key``, checked before anything changes: each of
    its servers' reads and what the load sets (clocks, step counts, the trainer's state).
    ``links``: the checkpoint and the saves it is incremental on, oldest first (``read_chain``):
    each server reads, for each, its share (from the newest save that holds the table whole)."""
    directory, manifest = links[-1]
    entry = manifest["tables"].get(key)
    if entry is None:
        raise CheckpointError(f"{os.path.join(directory, MANIFEST)} holds no table {key!r} (it holds "
                              f"{sorted(manifest['tables'])}): load with the names it was saved with")
    own = _own_state(directory, manifest["files"], entry["trainer_file"])
    _check_fits(key, entry, table, own)
    needed = [(directory, manifest, entry)]
    while needed[0][2].get("incremental"):
        if len(needed) == len(links):
            raise CheckpointError(f"{os.path.join(needed[0][0], MANIFEST)}: table {key!r} is saved incrementally "
                                  "there, but the manifest names no base (it was edited)")
        at, theirs = links[-len(needed) - 1]
        earlier = theirs["tables"].get(key)
        if earlier is None or earlier["name"] != entry["name"]:
            raise CheckpointError(f"{os.path.join(needed[0][0], MANIFEST)}: table {key!r} is saved incrementally on "
                                  f"{at}, which holds no such table (the manifest was edited)")
        needed.insert(0, (at, theirs, earlier))
    for at, theirs, part in needed:
        _check_layout(at, theirs, key, part, table)
    sketches = table.admit_after > 1
    evicting = entry["evicting"] and table.evict_after_steps is not None
    # a row's eviction clock counts its server's steps: an older save's rows are aged as the last's
    clocks = {saver: part["clock"] for saver, part in entry["servers"].items()}
    return {"reads": {s: [(at, _reads(part, theirs["files"], s, blocks, theirs["layout"],
                                      sketches and at == directory, clocks)) for at, theirs, part in needed]
                      for s, blocks in table._by_server.items()},
            "clock": int(entry["clock"]), "apply_clock": int(entry["clock"]) if evicting else None,
            "optimizer_steps": None if table.ps_mode == "geo" else int(entry["optimizer_steps"]), "own": own,
            "place": {"table": entry["name"], "versions": {s: tuple(p["versions"]) for s, p in
                                                             entry["servers"].items()}}}


# ---- PSModels: each dense server writes and reads its own blocks (dense/_shard_files.py) -----------


def _models_of(objects: Mapping[str, Any]) -> list[tuple[str, PSModel]]:
    """The PSModels of ``objects`` (already checked by :func:`_tables_of`), by name."""
    return [(name, obj) for name, obj in objects.items() if isinstance(obj, PSModel)]


def _settle_models(models: list[tuple[str, PSModel]]) -> None:
    """Before the servers read a model's blocks, as its ``state_dict()`` does: its pushes in
    flight land (its tables' too), half_async applies what is queued (and its next forward
    pulls what that made). The values the last step's answers brought stay the next forward's
    (a save changes nothing of training: no extra pull of the whole model)."""
    for _, model in models:
        model._wait_pushes()
        if model.ps_mode == "half_async":
            model.flush()


def _local_entries(model: PSModel) -> dict[str, tuple[nn.Module, str]]:
    """The keys of the local model's ``state_dict()`` that no server holds, each with its module
    and attribute: persistent buffers and extra states (``"_extra_state"``), the tables' inside
    it left out (they are saved as tables)."""
    tables = {id(t) for t in model._tables.values()}
    out: dict[str, tuple[nn.Module, str]] = {}

    def walk(module: nn.Module, prefix: str) -> None:
        if id(module) in tables:
            return
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                out[prefix + name] = (module, name)
        if getattr(type(module), "get_extra_state", nn.Module.get_extra_state) is not nn.Module.get_extra_state:
            out[prefix + "_extra_state"] = (module, "_extra_state")
        for name, child in module._modules.items():
            if child is not None:
                walk(child, f"{prefix}{name}.")

    walk(model.module, "")
    return out


class _ModelsBegun(NamedTuple):
    """The PSModels of a save begun: each one's trainer-side state as of the servers' snapshot
    (copies: buffers, ps_optimizer settings; geo: its optimizer and progress) and step, and the
    Future of what their servers wrote (in the background)."""

    models: list[tuple[str, PSModel]]
    owns: list[dict]
    steps: list[int]
    written: Any


def _begin_models(directory: str, layout: str, models: list[tuple[str, PSModel]], save: str,
                  timeout: float | None) -> _ModelsBegun:
    """Each model's dense servers copy their blocks (values and optimizer state) and write them
    under ``directory`` (``directory/<server>/`` in the local layout) in the background; this
    returns once they have copied them, with the trainer's own state of each model as of then."""
    each = [(key, model, server, slots) for key, model in models
            for server, slots in model._by_server().items() if slots]
    call_all([(server, _model_files._begin_model,
               (model.name, [s.name for s in slots], model._step, nested_seconds(model._seconds()),
                directory if layout == "shared" else os.path.join(directory, server), f"{key}.{server}", save))
              for key, model, server, slots in each], timeout=_timeout(models))
    owns = [_model_own(model) for _, model in models]
    written = call_all_async([(server, _model_files._model_written, (model.name, save))
                              for _, model, server, _ in each],
                             timeout=_timeout(models) if timeout is None else timeout)
    return _ModelsBegun(models, owns, [model._step for _, model in models], written)


def _model_own(model: PSModel) -> dict:
    """The trainer's own state of ``model`` for its file (copies): buffers and extra states,
    ps_optimizer settings; geo: its optimizer's state and progress since its last push."""
    own: dict[str, Any] = {
        "local": {k: m.get_extra_state() if attr == "_extra_state" else getattr(m, attr).detach().clone()
                  for k, (m, attr) in _local_entries(model).items()},
        "ps_optimizer": model.ps_optimizer.state_dict(), "geo": None}
    if model.ps_mode == "geo":  # (the optimizer is this trainer's own: its state and progress since its last push)
        state, per_element = model._trainer_optimizer_state()
        own["geo"] = {"state": state, "per_element": per_element, "progress": model._geo_progress()}
    return copy.deepcopy(own)


def _models_manifest(directory: str, layout: str, begun: _ModelsBegun, files: dict) -> dict:
    """The models' manifest entries, once their servers wrote (the trainer's file of each
    written here); every file is added to ``files``."""
    got = iter(wait_plain(begun.written))
    entries = {}
    for (key, model), own, step in zip(begun.models, begun.owns, begun.steps):
        written = {server: next(got) for server, slots in model._by_server().items() if slots}
        entries[key] = _model_manifest(directory, layout, key, model, written, files, own, step)
    return entries


def _model_manifest(directory: str, layout: str, key: str, model: PSModel, written: dict, files: dict, own: dict,
                    step: int) -> dict:
    """A model's manifest entry, from what each server wrote (``written``: ``ModelWritten`` by
    server) and the trainer's ``own`` state of it at ``step`` (:func:`_model_own`); writes the
    trainer's file of it (that state, with what of the optimizer state is not per element)."""
    def where(server: str) -> str:
        return "" if layout == "shared" else f"{server}/"

    for server, reply in written.items():
        for rel, (size, checksum) in reply.files.items():
            files[where(server) + rel] = file_record(size, checksum, server)
    first: dict[str, Any] = {}  # each parameter's first block: its state's keys are the parameter's
    for slot in model._slots:
        first.setdefault(slot.pname, slot)
    keys = {p: written[s.server].keys.get(s.name, []) for p, s in first.items()}
    scalars = {p: written[s.server].scalars.get(s.name, {}) for p, s in first.items()}
    own = {**own, "keys": keys, "scalars": scalars}
    rel = f"{key}.trainer.pt"
    files[rel] = file_record(*write_file(directory, rel, [own]), None)
    params = model._params()
    kwargs = model.optimizer[1]
    return {"name": model.name, "ps_mode": model.ps_mode, "optimizer": model.optimizer[0].__name__,
            "optimizer_settings": {k: v for k, v in kwargs.items() if isinstance(v, (bool, int, float, str))},
            "parameters": {p: {"shape": list(t.shape), "dtype": str(t.dtype)} for p, t in params.items()},
            "per_element": {p: [k for k in keys[p] if k not in scalars[p]] for p in first},
            # [block, parameter, offset, size, server, file]: a block is a flat range of its parameter
            "blocks": [[s.name, s.pname, s.block.offset, s.block.size, s.server,
                        f"{where(s.server)}{key}.{s.server}.pt"] for s in model._slots],
            "step": step, "server_steps": {server: reply.step for server, reply in written.items()},
            "trainer_file": rel}


def _check_model_fits(key: str, entry: dict, model: PSModel, own: dict) -> None:
    """``ValueError`` (nothing changed) unless the saved model ``entry`` fits ``model``: the
    checks of ``load_state_dict`` (strict) and ``load_optimizer_state_dict``."""
    if entry["optimizer"] != model.optimizer[0].__name__:
        raise ValueError(f"{key}: the optimizer state is for {entry['optimizer']!r}, this job uses "
                         f"{model.optimizer[0].__name__!r}")
    if (entry["ps_mode"] == "geo") != (model.ps_mode == "geo"):
        raise ValueError(f"{key}: the checkpoint's PSModel is ps_mode={entry['ps_mode']!r}, this one "
                         f"ps_mode={model.ps_mode!r} (geo keeps its optimizer on the trainer): load into a PSModel "
                         "geo or not as saved, or go through state_dict() and optimizer_state_dict()")
    mine = {p: list(t.shape) for p, t in model._params().items()}
    saved = {p: list(v["shape"]) for p, v in entry["parameters"].items()}
    local = _local_entries(model)
    missing = sorted(set(mine) - set(saved)) + sorted(set(local) - set(own["local"]))
    unexpected = sorted(set(saved) - set(mine)) + sorted(set(own["local"]) - set(local))
    if missing or unexpected:
        raise ValueError(f"{key}: the checkpoint's PSModel does not fit this one: missing key(s) {missing}, "
                         f"unexpected key(s) {unexpected}")
    for p, shape in mine.items():
        if saved[p] != shape:
            raise ValueError(f"size mismatch for {key}.{p}: the checkpoint's is {tuple(saved[p])}, this one "
                             f"{tuple(shape)}")
    for k, (m, attr) in local.items():
        value = own["local"][k]
        if attr != "_extra_state" and getattr(value, "shape", None) != getattr(m, attr).shape:
            raise ValueError(f"size mismatch for {key}.{k}: the checkpoint's is {tuple(getattr(value, 'shape', ()))}"
                             f", this one {tuple(getattr(m, attr).shape)}")
    if own["geo"] is not None:
        model._check_geo_progress(own["geo"]["progress"])


def _model_plan(directory: str, manifest: dict, key: str, model: PSModel) -> dict:
    """How ``model`` loads the checkpoint's ``key``, checked before anything changes: what each
    of its servers reads (its blocks' pieces of the saved blocks that overlap them, any number
    of saving servers in the shared layout) and the trainer's own file."""
    entry = manifest.get("models", {}).get(key)
    if entry is None:
        raise CheckpointError(f"{os.path.join(directory, MANIFEST)} holds no PSModel {key!r} (it holds "
                              f"{sorted(manifest.get('models', {}))}): load with the names it was saved with")
    own = _own_state(directory, manifest["files"], entry["trainer_file"])
    _check_model_fits(key, entry, model, own)
    saved: dict[str, list] = {}
    for block, pname, offset, size, server, rel in entry["blocks"]:
        saved.setdefault(pname, []).append((rel, block, offset, size))
    if manifest["layout"] == "local":
        theirs = sorted((b[0], b[2], b[3], b[4]) for b in entry["blocks"])
        mine = sorted((s.name, s.block.offset, s.block.size, s.server) for s in model._slots)
        if theirs != mine:
            raise CheckpointError(
                f"{os.path.join(directory, MANIFEST)}: PSModel {key!r} was saved in the local layout (each server "
                f"under {directory}/<server>/ on its own disk) by servers {sorted({b[4] for b in entry['blocks']})}; "
                f"this PSModel's blocks are sliced or placed otherwise (servers {sorted(model._by_server())}). A local "
                "checkpoint loads only onto the same servers holding the same blocks: save with layout='shared' (a "
                "directory every server reads) to load onto other servers")
    reads = {}
    for server, slots in model._by_server().items():
        if not slots:
            continue
        try:
            blocks = {s.name: _model_files.BlockReads(
                s.block.size, _model_files.pieces(saved[s.pname], s.block.offset, s.block.size),
                [] if own["geo"] is not None else list(own["keys"][s.pname]), own["scalars"].get(s.pname, {}))
                for s in slots}
        except ValueError as exc:
            raise CheckpointError(f"{os.path.join(directory, MANIFEST)}: PSModel {key!r}: {exc} (the manifest was "
                                  "edited)") from None
        rels = sorted({piece.rel for plan in blocks.values() for piece in plan.pieces})
        reads[server] = ([FileEntry(*file_entry(manifest["files"], rel)) for rel in rels], blocks)
    return {"name": model.name, "reads": reads, "own": own}


def _model_calls(directory: str, load: str, plans: list[dict], timeout: float | None) -> tuple[list, list, list]:
    """The calls of load ``load`` of the models ``plans``: each server stages (checks its files
    and assembles its blocks), drops them (another server refused), applies them."""
    servers = [(plan["name"], server, files, blocks) for plan in plans
               for server, (files, blocks) in plan["reads"].items()]
    return ([(server, _model_files._stage_model, (name, load, directory, files, blocks, timeout))
             for name, server, files, blocks in servers],
            [(server, _model_files._drop_model, (name, load)) for name, server, _, _ in servers],
            [(server, _model_files._apply_model, (name, load)) for name, server, _, _ in servers])


def _models_loaded(models: list[tuple[str, PSModel]], plans: list[dict]) -> None:
    """The trainer's side of the models' load, after the servers applied theirs, as
    ``load_state_dict`` then ``load_optimizer_state_dict`` leave it: the buffers, the
    ps_optimizer settings, geo's optimizer and progress; the next forward pulls the values
    loaded (the local parameters show them from then on)."""
    for (_, model), plan in zip(models, plans):
        own = plan["own"]
        with torch.no_grad():
            for k, (m, attr) in _local_entries(model).items():
                if attr == "_extra_state":
                    m.set_extra_state(own["local"][k])
                else:
                    getattr(m, attr).copy_(own["local"][k])
        model._ready = None
        model.ps_optimizer.load_state_dict(own["ps_optimizer"])
        model._sent_settings = None  # the next step sends them
        if own["geo"] is not None:
            model._load_trainer_optimizer_state(own["geo"]["state"])
            model._load_geo_progress(own["geo"]["progress"])
