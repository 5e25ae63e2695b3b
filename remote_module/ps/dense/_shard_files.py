"""A dense server writes and reads its own blocks of a PSModel for a shard checkpoint
(``remote_module.ps.save_shards`` / ``load_shards``): no parameter passes through the trainer,
and no server waits for another.

What a server writes for its blocks is what the trainer-side checkpoint holds for them
(``state_dict()``'s parameters, ``optimizer_state_dict()``'s state), read as
``_server._pull`` and ``_server._optimizer_state`` read them: ``<stem>.pt``, ``torch.save`` of
``{"job": name, "blocks": {block: {"value": its flat values, "state": its optimizer's state}}}``.
What of the state is per element (a tensor of the block's size, e.g. momentum, Adam's moments)
the trainer re-slices; the rest (e.g. Adam's ``step``) is answered to the trainer, which keeps
the parameter's first block's (as ``optimizer_state_dict()`` does) in its own file.

A load is two calls: :func:`_stage_model` checks every file the trainer names (size and
checksum, as the manifest records them) and assembles this server's blocks from the saved blocks
that overlap them (any number of servers saved them), changing nothing; once every server
staged, :func:`_apply_model` loads them with the handlers a trainer-side load uses
(``_set_values``, then ``_load_optimizer_state``). A corrupt file on any server so leaves the
model as it was.
"""

from __future__ import annotations

import os
import pickle
from functools import partial
from typing import Any, NamedTuple

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from remote_module.ps._modes import read_when_applied
from remote_module.ps._shard_io import FileEntry, StagedLoads, load_file, verify, write_file, writes
from remote_module.ps.dense import _server


class ModelWritten(NamedTuple):
    """What a server wrote of a PSModel (:func:`_begin_model`): its ``files`` (``{rel: (size,
    checksum)}``), per block the optimizer state's keys in order (``keys``) and the values of
    those that are not per element (``scalars``, small), and the job's sync step here."""

    files: dict[str, tuple[int, str]]
    keys: dict[str, list[str]]
    scalars: dict[str, dict[str, Any]]
    step: int


class Piece(NamedTuple):
    """Elements ``at .. at + count`` of a saved block (``block`` in file ``rel``) that are
    elements ``to .. to + count`` of one of this server's blocks."""

    rel: str
    block: str
    at: int
    to: int
    count: int


class BlockReads(NamedTuple):
    """How one of this server's blocks is assembled at a load: its ``size``, its ``pieces``,
    its optimizer state's keys in order (``keys``: per element, assembled from the same pieces,
    unless in ``scalars``, whose values it takes as they are)."""

    size: int
    pieces: list[Piece]
    keys: list[str]
    scalars: dict[str, Any]


#: the loads staged here (values and optimizer state by block), by (job, load)
_staged = StagedLoads()


def _per_element(value: Any, size: int) -> bool:
    """Whether a block's optimizer state ``value`` is per element (as ``optimizer_state_dict()``
    tells: a 1-d tensor of the block's size)."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == size


def _snapshot(job: Any, blocks: list[str]) -> tuple[dict, dict, int]:
    """The blocks' values and optimizer state now (copies), and the job's sync step (lock held)."""
    values = dict(zip(blocks, job.values(blocks)))
    return values, _server._optimizer_state(job.name, blocks), job.sync.done


@rpc.functions.async_execution
def _begin_model(name: str, blocks: list[str], step: int, seconds: float, directory: str, stem: str,
                 save: str) -> Future:
    """Copy this server's ``blocks`` of job ``name`` (sync: once step ``step - 1`` is applied
    here, as a pull for ``step`` reads them) under the job's lock, then write them to
    ``directory/stem.pt`` in the background (``_shard_io.writes``); answered once copied (pushes
    wait only for the copy). :func:`_model_written` answers with the outcome."""
    job = _server._job(name)
    if writes.begun(("model", save, name)):
        raise ValueError(f"PSModel {name!r}: save {save!r} was begun here already")
    read = read_when_applied(job, step, seconds, _snapshot, job, blocks)
    return read.then(lambda fut: writes.begin(("model", save, name), partial(_write, name, fut.value(), directory,
                                                                             stem),
                                              f"PSModel {name!r}: writing {os.path.join(directory, stem)}.pt"))


@rpc.functions.async_execution
def _model_written(name: str, save: str) -> Future:
    """What the background save ``save`` of job ``name`` wrote (a :class:`ModelWritten`), once
    it has; its failure (``OSError``); ``LookupError`` if no such save was begun here."""
    return writes.outcome(("model", save, name), f"PSModel {name!r}, save {save!r}")


def _write(name: str, snapshot: tuple[dict, dict, int], directory: str, stem: str) -> ModelWritten:
    values, states, version = snapshot
    keys = {b: list(state) for b, state in states.items()}
    scalars = {b: {k: v for k, v in state.items() if not _per_element(v, values[b].numel())}
               for b, state in states.items()}
    saved = {b: {"value": values[b], "state": states[b]} for b in values}
    rel = f"{stem}.pt"
    return ModelWritten({rel: write_file(directory, rel, [{"job": name, "blocks": saved}])}, keys,
                        scalars, version)


def _stage_model(name: str, load: str, directory: str, files: list[FileEntry], reads: dict[str, BlockReads],
                 timeout: float | None = None) -> str | None:
    """Check ``files`` and assemble this server's blocks of job ``name`` (``reads``: by block)
    for load ``load``, kept until :func:`_apply_model`; nothing of the job changes. Why it
    cannot be loaded (a file missing, truncated or corrupt, named), or None."""
    _staged.forget_expired()
    job = _server._job(name)
    unknown = sorted(b for b in reads if b not in job.params)
    if unknown:
        return f"parameter-server job {name!r} has no blocks {unknown} on {rpc.get_worker_info().name!r}"
    try:
        for entry in files:
            verify(directory, entry)
        opened: dict[str, dict] = {}

        def saved(rel: str) -> dict:
            if rel not in opened:
                opened[rel] = load_file(os.path.join(directory, rel))["blocks"]
            return opened[rel]

        values, states = {}, {}
        for block, plan in reads.items():
            values[block] = _assembled(plan, lambda p: saved(p.rel)[p.block]["value"])
            state = {}
            for key in plan.keys:
                if key in plan.scalars:
                    value = plan.scalars[key]
                    state[key] = value.clone() if isinstance(value, torch.Tensor) else value
                else:
                    state[key] = _assembled(plan, lambda p, key=key: saved(p.rel)[p.block]["state"][key])
            states[block] = state
    except (ValueError, OSError, RuntimeError, EOFError, KeyError, pickle.UnpicklingError) as exc:
        return str(exc) if isinstance(exc, ValueError) else f"{directory}: a file does not read: {exc!r}"
    _staged.put((name, load), (values, states), timeout)
    return None


def _assembled(plan: BlockReads, source: Any) -> torch.Tensor:
    """One of this server's blocks, flat, from its ``plan``'s pieces (``source(piece)``: the
    saved block's tensor the piece is part of)."""
    if not plan.pieces:  # (a parameter of no elements)
        return torch.empty(0)
    out = torch.empty(plan.size, dtype=source(plan.pieces[0]).dtype)
    for piece in plan.pieces:
        out[piece.to:piece.to + piece.count] = source(piece)[piece.at:piece.at + piece.count]
    return out


def _apply_model(name: str, load: str) -> None:
    """Load what :func:`_stage_model` staged for ``load``, as a trainer-side load of the same
    checkpoint would: the values (``_set_values``), then the optimizer state
    (``_load_optimizer_state``: none in geo mode, whose optimizer is the trainer's)."""
    staged = _staged.pop((name, load))
    if staged is None:
        raise LookupError(f"parameter-server job {name!r}: no checkpoint staged here for load {load!r} (forgotten: "
                          "its trainer took longer than its timeout allows)")
    values, states = staged
    _server._set_values(name, values)
    if _server._job(name).spec.mode != "geo":
        _server._load_optimizer_state(name, states)


def _drop_model(name: str, load: str) -> None:
    """Forget load ``load``'s staged blocks of job ``name`` (another server refused its files)."""
    _staged.pop((name, load))


def pieces(saved: list[tuple[str, str, int, int]], offset: int, size: int) -> list[Piece]:
    """The pieces of the flat parameter range ``offset .. offset + size`` (one block) among the
    ``saved`` blocks of the same parameter (``(file, block, offset, size)``); ``ValueError``
    unless they cover it."""
    out, covered = [], 0
    for rel, block, first, count in sorted(saved, key=lambda s: s[2]):
        lo, hi = max(first, offset), min(first + count, offset + size)
        if lo < hi:
            out.append(Piece(rel, block, lo - first, lo - offset, hi - lo))
            covered += hi - lo
    if covered != size:
        raise ValueError(f"the saved blocks cover {covered} of the {size} elements at {offset}")
    return out
