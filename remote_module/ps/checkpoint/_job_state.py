"""What a whole-job checkpoint (:mod:`._checkpointer`) holds besides its files' layout: the
parameter servers' objects (the seam: tables, collections and ``PSModel``\\ s as their
servers' own shard files), each trainer's ``ps_optimizer`` settings, and this process's own
state (RNG states, local objects)."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any, Mapping

import torch

from remote_module.ps.checkpoint._job_files import PS_DIR, PS_FILE
from remote_module.ps.checkpoint._manifest import read_manifest
from remote_module.ps.checkpoint._shards import ShardSave, begin_save_shards, load_shards
from remote_module.ps.dense._model import PSModel

# ---- the seam: the servers' objects -------------------------------------------------------------


def _save_ps(path: Path, objects: Mapping[str, Any]) -> None:
    """Save the parameter servers' ``objects`` (name -> table, collection or ``PSModel``) into
    the directory ``path``; run by one trainer only: :func:`_begin_ps`, waited for."""
    begun = _begin_ps(path, objects)
    if begun is not None:
        begun.wait()



def _begin_ps(path: Path, objects: Mapping[str, Any], timeout: float | None = None,
              keep_snapshot_s: float = 0.0, token: str | None = None, base: Path | None = None) -> ShardSave | None:
    """Begin saving the parameter servers' ``objects`` (name -> table, collection or
    ``PSModel``) into the directory ``path``; run by one trainer only. Returns the servers'
    save, in the background (None without objects): complete once its ``wait()`` returned.

    ``begin_save_shards(path / "ps", ...)`` (shared layout): each table server takes a
    snapshot of its blocks and writes it there in the background (a PSModel's servers write
    theirs before this returns); the trainer writes only its own small files (``ps_optimizer``
    settings, a PSModel's buffers; geo: its optimizer and progress) and, at ``wait()``, the
    small ``ps/manifest.json`` (every shard file's size and CRC-32, last); no row or parameter
    passes through the trainer. ``timeout``: seconds the servers' writing may take;
    ``keep_snapshot_s``: how long the servers keep the snapshot's memory for the next save;
    ``token``, ``base``: an incremental save on the ``ps/`` of ``base`` (``save_shards``).
    """
    return (begin_save_shards(path / PS_DIR, objects, timeout=timeout, keep_snapshot_s=keep_snapshot_s, token=token,
                              base=None if base is None else base / PS_DIR) if objects else None)


def _check_names(path: Path, objects: Mapping[str, Any], models_saved: Mapping[str, Any]) -> None:
    """``KeyError`` (nothing loaded) unless the checkpoint ``path`` holds each of ``objects``
    under its name, as the same kind (a table, collection or ``PSModel`` in ``ps/``; or, saved
    before PSModels went to ``ps/``, a ``PSModel`` in ``ps.pt``, read as ``models_saved``);
    ``CheckpointError`` for a ``ps/`` without its manifest (torn)."""
    saved = {}
    if (path / PS_DIR).is_dir():
        saved.update({name: ("ps/", what["kind"] == "model")
                      for name, what in read_manifest(str(path / PS_DIR))["objects"].items()})
    saved.update({name: (PS_FILE, True) for name in models_saved})
    wrong = sorted(n for n, obj in objects.items() if saved.get(n, (None, None))[1] != isinstance(obj, PSModel))
    if wrong:
        listed = ", ".join(f"{n} ({'PSModel' if model else 'table or collection'} in {where})"
                           for n, (where, model) in sorted(saved.items()))
        raise KeyError(f"the checkpoint {path} has no parameter-server object(s) {wrong} as this job has them (it has "
                       f"{listed or 'none'}): pass the same ps= names and objects as the job that saved it")


def _load_ps(path: Path, objects: Mapping[str, Any]) -> None:
    """Load the parameter servers' ``objects`` from the checkpoint directory ``path``; run by
    one trainer only (the one that saves), before any trainer trains.

    ``load_shards(path / "ps", ...)``: each server reads and checks (size, CRC-32) its own
    blocks' files (a table's rows, a PSModel's parameters and optimizer state); a file missing,
    truncated or corrupt raises :class:`CheckpointError` naming it, with nothing loaded. A
    checkpoint saved when PSModels still went through the trainer holds them in ``ps.pt``
    (``state_dict()`` and ``optimizer_state_dict()``): those are read from there and sent to the
    servers, after the rest. (``load_shards`` also sets this trainer's ``ps_optimizer``
    settings from the saving trainer's; every trainer then restores its own from its own file,
    which wins: :func:`_set_ps_settings`.)"""
    old = torch.load(path / PS_FILE, weights_only=False) if (path / PS_FILE).is_file() else {}
    _check_names(path, objects, old)
    shards = {name: obj for name, obj in objects.items() if name not in old}
    if shards:
        load_shards(path / PS_DIR, shards)
    for name, obj in objects.items():
        if name in old:
            obj.load_state_dict(old[name]["state"])
            obj.load_optimizer_state_dict(old[name]["optim"])


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
