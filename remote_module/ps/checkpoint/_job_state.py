"""What a whole-job checkpoint (:mod:`._checkpointer`) holds besides its files' layout: the
parameter servers' objects (the seam: tables and collections as their servers' own shard
files, ``PSModel``\\ s through the first trainer), each trainer's ``ps_optimizer`` settings,
and this process's own state (RNG states, local objects)."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any, Mapping

import torch

from remote_module.ps.checkpoint._job_files import PS_DIR, PS_FILE, _write
from remote_module.ps.checkpoint._manifest import read_manifest
from remote_module.ps.checkpoint._shards import ShardSave, begin_save_shards, load_shards
from remote_module.ps.tables._collection import ShardedEmbeddingBagCollection
from remote_module.ps.tables._embedding import ShardedEmbedding

# ---- the seam: the servers' objects -------------------------------------------------------------


def _split(objects: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``objects`` as ``(shards, models)``: the tables and collections, which their servers save
    and load themselves (:func:`~._shards.save_shards`), and the rest (``PSModel``\\ s), which go
    through the trainer's ``state_dict()``."""
    shards = {name: obj for name, obj in objects.items()
              if isinstance(obj, (ShardedEmbedding, ShardedEmbeddingBagCollection))}
    return shards, {name: obj for name, obj in objects.items() if name not in shards}


def _save_ps(path: Path, objects: Mapping[str, Any]) -> None:
    """Save the parameter servers' ``objects`` (name -> table, collection or ``PSModel``) into
    the directory ``path``; run by one trainer only: :func:`_begin_ps`, waited for."""
    begun = _begin_ps(path, objects)
    if begun is not None:
        begun.wait()


def _begin_ps(path: Path, objects: Mapping[str, Any], timeout: float | None = None) -> ShardSave | None:
    """Begin saving the parameter servers' ``objects`` (name -> table, collection or
    ``PSModel``) into the directory ``path``; run by one trainer only. Returns the servers'
    save of the tables, in the background (None without tables): complete once its ``wait()``
    returned.

    Tables and collections: ``begin_save_shards(path / "ps", ...)`` (shared layout): each
    server takes a snapshot of its blocks and writes it there in the background, the trainer
    only its ``ps_optimizer`` settings now and the small ``ps/manifest.json`` (every shard
    file's size and SHA-256) at ``wait()``; no row passes through the trainer. ``PSModel``\\ s
    (which ``save_shards`` does not take): their ``state_dict()`` and
    ``optimizer_state_dict()``, gathered here and written with ``torch.save`` to ``ps.pt``
    before this returns. ``timeout``: seconds the servers' writing may take.
    """
    shards, models = _split(objects)
    begun = begin_save_shards(path / PS_DIR, shards, timeout=timeout) if shards else None
    if models:
        _write(path / PS_FILE, {name: {"state": obj.state_dict(), "optim": obj.optimizer_state_dict()}
                                for name, obj in models.items()})
    return begun


def _check_names(path: Path, objects: Mapping[str, Any], models_saved: Mapping[str, Any]) -> None:
    """``KeyError`` (nothing loaded) unless the checkpoint ``path`` holds each of ``objects``
    under its name, as the same kind (a table or collection in ``ps/``, a ``PSModel`` in
    ``ps.pt``, read as ``models_saved``); ``CheckpointError`` for a ``ps/`` without its manifest
    (torn)."""
    shards, models = _split(objects)
    saved = {}
    if (path / PS_DIR).is_dir():
        saved.update({name: "ps/" for name in read_manifest(str(path / PS_DIR))["objects"]})
    saved.update({name: PS_FILE for name in models_saved})
    wrong = sorted([n for n in shards if saved.get(n) != "ps/"] + [n for n in models if saved.get(n) != PS_FILE])
    if wrong:
        raise KeyError(f"the checkpoint {path} has no parameter-server object(s) {wrong} as this job has them (it has "
                       f"tables and collections in ps/: {sorted(n for n, w in saved.items() if w == 'ps/')}, "
                       f"PSModels in {PS_FILE}: {sorted(n for n, w in saved.items() if w == PS_FILE)}): pass the "
                       "same ps= names and objects as the job that saved it")


def _load_ps(path: Path, objects: Mapping[str, Any]) -> None:
    """Load the parameter servers' ``objects`` from the checkpoint directory ``path``; run by
    one trainer only (the one that saves), before any trainer trains.

    Tables and collections: ``load_shards(path / "ps", ...)``, each server reading and checking
    (size, SHA-256) its own blocks' files; a file missing, truncated or corrupt raises
    :class:`CheckpointError` naming it, with nothing loaded. ``PSModel``\\ s: their state and
    optimizer state, read from ``ps.pt`` and sent to the servers, after the tables. (``load_shards``
    also sets this trainer's ``ps_optimizer`` settings from the saving trainer's; every trainer
    then restores its own from its own file, which wins: :func:`_set_ps_settings`.)"""
    shards, models = _split(objects)
    saved = torch.load(path / PS_FILE, weights_only=False) if (path / PS_FILE).is_file() else {}
    _check_names(path, objects, saved)
    if shards:
        load_shards(path / PS_DIR, shards)
    for name, obj in models.items():
        obj.load_state_dict(saved[name]["state"])
        obj.load_optimizer_state_dict(saved[name]["optim"])


def _read_ps(path: Path, objects: Mapping[str, Any]) -> dict[str, dict]:
    """What the checkpoint ``path`` holds of the servers' objects: loaded into ``objects``
    (fresh ones, built as the job's, under other server-side names), then ``{name: {"state":
    state_dict(), "optim": optimizer_state_dict()}}`` of each (part of the seam: tests compare a
    job's tables with it)."""
    _load_ps(path, objects)
    return {name: {"state": obj.state_dict(), "optim": obj.optimizer_state_dict()} for name, obj in objects.items()}


def _owners(obj: Any) -> list[tuple[str, Any]]:
    """``(name, module)`` of ``obj`` and each module inside it that has a ``ps_optimizer`` (a
    PSModel and its tables, a collection and its tables, a table)."""
    if not hasattr(obj, "named_modules"):
        return [("", obj)]
    return [(name, m) for name, m in obj.named_modules() if hasattr(m, "ps_optimizer")]


def _ps_settings(objects: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """This trainer's ``ps_optimizer`` settings of every object (and of the tables inside it),
    which every trainer saves and restores for itself: an LR scheduler's state does not hold
    the lr (torch keeps it in the optimizer), so without them a resumed trainer would push the
    initial lr (in sync mode the servers refuse a step whose trainers' settings differ)."""
    return {name: {qual: m.ps_optimizer.state_dict() for qual, m in _owners(obj)} for name, obj in objects.items()}


def _set_ps_settings(objects: Mapping[str, Any], saved: Mapping[str, Mapping[str, Any]]) -> None:
    for name, obj in objects.items():
        mine = saved.get(name, {})
        for qual, m in _owners(obj):
            if qual in mine:
                m.ps_optimizer.load_state_dict(mine[qual])


# ---- state of this process ------------------------------------------------------------------------


def _rng_state() -> dict[str, Any]:
    """This process's random number generators' states: torch's, CUDA's (once initialised),
    numpy's (when numpy is imported) and Python's ``random``."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])


def _state_of(obj: Any) -> Any:
    if isinstance(obj, torch.Generator):
        return {"generator": obj.get_state()}
    return obj.state_dict()


def _load_into(obj: Any, state: Any) -> None:
    if isinstance(obj, torch.Generator):
        obj.set_state(state["generator"])
    else:
        obj.load_state_dict(state)
