"""A checkpointer for a whole parameter-server job, and its resume after a restart.

A checkpoint is a directory ``step-XXXXXXXX/`` under the checkpointer's path (the step index:
steps done), holding

- the parameter servers' objects, saved and loaded once, by the first of ``trainers``
  (:func:`~._job_state._begin_ps` / :func:`~._job_state._load_ps`) in ``ps/``: a
  :func:`~._shards.save_shards` checkpoint that each server writes (and reads) its own blocks
  of (a table's rows, a ``PSModel``'s parameters and optimizer state), the trainer only
  ``ps/manifest.json`` (every shard file's size and CRC-32) and its own small files
  (``ps_optimizer`` settings, a ``PSModel``'s buffers); a checkpoint saved before PSModels
  went to ``ps/`` holds them in ``ps.pt`` and still loads; with ``full_every`` > 1, the
  tables of most checkpoints are incremental saves on the checkpoint before (``ps/`` names it);
- ``trainer-<r>.pt`` for each trainer ``r``: its local objects' ``state_dict()`` (model,
  optimizer, LR scheduler, a data loader's own state; a ``torch.Generator``'s state), its
  ``ps_optimizer`` settings of the servers' objects (what its schedulers set), its RNG
  states (torch's, CUDA's once initialised, numpy's when numpy is imported, Python's
  ``random``) and the step index;
- ``manifest.json``, written last: every file's size and SHA-256 (of ``ps/``, its manifest
  only: that lists the shard files, so the first trainer never reads the rows), the step and the
  number of trainers.

How a checkpoint becomes complete: at its step, every trainer writes its state into a staging
directory ``.step-XXXXXXXX.tmp/`` (under a ``.part`` name, then renamed; not fsynced: the
first trainer makes every file durable before the manifest), and the first trainer has the
servers take a snapshot of their blocks (training waits only for that), which they write there
in the background. The first trainer, at a later ``step()`` (or at ``close()``, waiting then),
sees every trainer's file there and every server's write done and hands the checkpoint to a
thread of its own, which writes the tables' manifest, fsyncs the trainers' files, writes the
checkpoint's manifest and renames the directory to ``step-XXXXXXXX``, then removes the
checkpoints beyond ``keep`` (a failure there is raised at a later ``step()``). The rename is
what makes a checkpoint visible, so one torn by a kill stays a staging directory and is never
loaded (the next resume removes it). No trainer waits for another while saving, and the first
trainer's waits are bounded (``timeout``): a checkpoint still missing a trainer's file after
``timeout`` seconds raises ``TimeoutError`` naming the trainers. A save begins only once the
one before it is complete (the first trainer waits for it then, which it does only when saves
come faster than the servers write), so the servers hold one snapshot at a time.

Resume: the first trainer picks the newest checkpoint whose manifest holds (every file there,
of its size and checksum, and every shard file ``ps/manifest.json`` lists, of its size; else a
warning names the directory and why, and the previous one is tried), loads the servers' part
(each server checks its shard files' CRC-32 first: a corrupt one raises ``CheckpointError``,
nothing is loaded, and the previous checkpoint is tried the same way), and answers the other
trainers (over RPC) which checkpoint it loaded; each then loads its own file (its own
``ps_optimizer`` settings among it: they win over those ``load_shards`` set on the first). The
other trainers' ``resume()`` returns only after the servers' part is loaded, so no trainer
trains on the old values.

Files are read with ``torch.load(weights_only=False)``: a checkpoint directory is as trusted as
the job's own code (an RPC world is one trust domain already; see tutorials/security.md).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

import torch
import torch.distributed.rpc as rpc

from remote_module.ps._shard_io import file_sha256, save_bytes
from remote_module.ps.checkpoint._job_files import (
    _STAGING,
    FORMAT,
    MANIFEST,
    PS_DIR,
    STEP_DIR,
    _files,
    _trainer_file,
    _unloadable,
    _write_bytes,
    complete_checkpoints,
)
from remote_module.ps.checkpoint._job_state import (
    _begin_ps,
    _load_into,
    _load_ps,
    _ps_settings,
    _rng_state,
    _set_ps_settings,
    _set_rng_state,
    _state_of,
)
from remote_module.ps.checkpoint._manifest import CheckpointError, read_chain, read_manifest, sync_directory
from remote_module.ps.checkpoint._shards import ShardSave, _tables_of, end_save_chain, release_snapshot_memory

#: seconds between looks at a staging directory while waiting for the trainers' files
_POLL_S = 0.05
#: the servers keep a save's snapshot memory for the next save at least this long, and three
#: times the time between the last two saves (times ``full_every``: the next full save's)
#: (``begin_save_shards(keep_snapshot_s=...)``)
KEEP_SNAPSHOT_MIN_S = 120.0

# ---- the gate: the other trainers wait until the first one loaded the servers' part ------------


class _Resumed(NamedTuple):
    """What the first trainer's resume tells the others: the step it resumed from, the
    checkpoint directory's name (None: none, a fresh start), or why it failed."""

    step: int
    directory: str | None
    error: str | None


class _Gate:
    def __init__(self) -> None:
        self.opened = threading.Event()
        self.resumed: _Resumed | None = None


_gates: dict[str, _Gate] = {}
_gates_lock = threading.Lock()


def _gate(key: str) -> _Gate:
    with _gates_lock:
        return _gates.setdefault(key, _Gate())


def _wait_resumed(key: str, timeout: float) -> _Resumed:
    """(Run on the first trainer, over RPC, by the others' ``resume()``) its resume's outcome,
    once it has one (at most ``timeout`` seconds)."""
    gate = _gate(key)
    if not gate.opened.wait(timeout) or gate.resumed is None:
        return _Resumed(0, None, f"it did not finish its resume() within {timeout:g} s")
    return gate.resumed


# ---- the checkpointer -------------------------------------------------------------------------------

#: this process's checkpointers (a resume waits for the background work of another of its path)
_checkpointers: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


class _Pending(NamedTuple):
    """A checkpoint the first trainer started: its step, staging directory, when, and the
    servers' save of the tables, written in the background (None without tables)."""

    step: int
    staging: Path
    since: float
    ps: ShardSave | None


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a whole number of at least 1, got {value!r}")
    return value


class Checkpointer:
    """Checkpoints of a whole job every ``every_steps`` steps, the newest ``keep`` kept, and
    the resume of a restarted job from the newest complete one.

    Every trainer builds one with the same arguments (its own objects) and calls
    :meth:`resume` once before training, :meth:`step` last in each training step (what a step
    does after it, e.g. an LR scheduler's step, is not in that step's checkpoint) and
    :meth:`close` at the end. ``ps`` names the parameter servers' objects (tables, collections,
    ``PSModel``\\ s: saved and loaded once, for the first trainer; their servers write, in the
    background, and read their own blocks' files; every trainer restores its ``ps_optimizer``
    settings); ``local`` names this
    trainer's own objects, each with ``state_dict()`` / ``load_state_dict()`` (a model, an
    optimizer, an LR scheduler, a data loader such as torchdata's ``StatefulDataLoader``) or a
    ``torch.Generator``. The RNG states (torch, CUDA, numpy, ``random``) and the step index are
    saved too. ``trainers``: every
    trainer's worker name, in the same order on each (default: the ``"trainer"`` role of the
    world ``rpc_backend`` formed; without one, this process alone); the first saves the servers'
    part. ``path`` must be one directory that every trainer and every server of the tables sees
    at the same absolute path (a shared filesystem across machines): the servers write their
    shard files into it. ``timeout``: seconds any wait may take (a trainer's file of a checkpoint, the
    first trainer's resume) before it raises naming what did not come.

    ``full_every``: 1 (the default) saves every checkpoint whole; K > 1 saves the tables whole
    every K-th checkpoint and, in the K - 1 between, only the rows changed since the checkpoint
    before (an incremental save, ``save_shards(base=...)``: its ``ps/`` names its base; the
    rest, a PSModel's dense blocks and every trainer's file, is saved whole each time; tables
    inside a PSModel are incremental too). It pays when a save's interval touches a small part
    of the tables (a changed row is written with its id: a table whose rows mostly change writes
    about as much as whole). A resume loads the newest checkpoint with the
    ones it is incremental on; ``keep`` keeps the newest ``keep`` and every checkpoint they are
    incremental on (up to K - 1 more); a damaged save makes every checkpoint of its chain after
    it unloadable (resume falls back past them, saying so). The first save after a resume is
    whole.

    Exact resume: in sync mode with batches determined by the step index (or a data loader
    whose state is saved), a job killed and resumed ends bit for bit as an uninterrupted one. In
    the async modes the servers' part is read while other trainers may push, and the steps
    since the checkpoint are lost. geo mode is refused (each trainer's optimizer is its own:
    checkpoint it as tutorials/parameter-servers.md#checkpoints says).

    Example (every trainer of a torchrun job; ps0 only serves)::

        me = rpc_backend.init_from_env(roles={"ps": 1, "trainer": 2})
        emb = ShardedEmbeddingBag(1000, 16, me.workers("ps"), name="emb", ps_mode="sync", num_trainers=2)
        head = torch.nn.Linear(16, 1)
        opt = torch.optim.SGD(head.parameters(), lr=0.1)
        ckpt = Checkpointer("ckpt", every_steps=100, keep=2, ps={"emb": emb}, local={"head": head, "opt": opt})
        for step in range(ckpt.resume(), 1000):   # 0, or the step the newest checkpoint holds
            train_step(step)                       # (your step: batches chosen by the step index)
            ckpt.step()                            # saves after steps 100, 200, ...
        ckpt.close()
    """

    def __init__(self, path: str | os.PathLike, *, every_steps: int, keep: int = 2,
                 ps: Mapping[str, Any] | None = None, local: Mapping[str, Any] | None = None,
                 trainers: Sequence[str] | None = None, timeout: float = 300.0, full_every: int = 1) -> None:
        self.path = Path(path)
        self.every_steps = _positive_int("every_steps", every_steps)
        self.keep = _positive_int("keep", keep)
        self.full_every = _positive_int("full_every", full_every)
        if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.timeout = float(timeout)
        self.ps = dict(ps or {})
        self.local = dict(local or {})
        for name, obj in self.ps.items():
            missing = [m for m in ("state_dict", "optimizer_state_dict", "load_state_dict",
                                   "load_optimizer_state_dict", "ps_optimizer") if not hasattr(obj, m)]
            if missing:
                raise TypeError(f"ps[{name!r}] must be a table, collection or PSModel of remote_module.ps, got "
                                f"{type(obj).__name__} (it has no {', '.join(missing)})")
            if getattr(obj, "ps_mode", None) == "geo":
                raise ValueError(f"ps[{name!r}] is in geo mode, whose optimizer state is each trainer's own: "
                                 "Checkpointer does not save it; checkpoint a geo job as "
                                 "tutorials/parameter-servers.md#checkpoints says")
        if self.ps:  # (what the first save would refuse, a table given twice, say: now, not every_steps later)
            _tables_of(self.ps)
        for name, obj in self.local.items():
            if not isinstance(obj, torch.Generator) and not (hasattr(obj, "state_dict")
                                                             and hasattr(obj, "load_state_dict")):
                raise TypeError(f"local[{name!r}] must have state_dict() and load_state_dict() (a model, optimizer, "
                                f"scheduler, data loader) or be a torch.Generator, got {type(obj).__name__}")
        self.trainers = list(trainers) if trainers is not None else _default_trainers()
        me = rpc.get_worker_info().name if self.trainers else None
        if self.trainers and me not in self.trainers:
            raise ValueError(f"this worker, {me!r}, is not among trainers={self.trainers}")
        #: this trainer's index among the trainers (0: it saves and loads the servers' part)
        self.rank = self.trainers.index(me) if self.trainers else 0
        #: the steps done (set by :meth:`resume`, counted by :meth:`step`)
        self.step_index = 0
        self._key = str(path)
        self._resumed = False
        self._pending: list[_Pending] = []
        self._saved: int | None = None  # the step of the last save() (saved once per step)
        self._saved_at: float | None = None  # when (time.monotonic())
        # checkpoints are completed (manifests, fsyncs, renames, old ones removed) on a thread of their own
        self._completer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="remote_module-checkpointer")
        self._completing: list[Future] = []
        self._lock = threading.Lock()  # (the lists above: a servers' write that finished hands over too)
        self._closed = [False]
        _checkpointers.add(self)
        weakref.finalize(self, _warn_unclosed, self._pending, self._closed, str(self.path))
        self._figures = {"saves": 0, "save_s": 0.0, "completed": 0, "bytes": None, "write_s": None,
                         "incremental": 0}
        # incremental saves (full_every > 1): the newest checkpoint this checkpointer completed
        # (the next one's base) and how many saves its chain holds (1: a full one)
        self._base: Path | None = None
        self._chained = 0

    @property
    def _count(self) -> int:
        return max(1, len(self.trainers))

    @property
    def _token(self) -> str:
        """The token of this checkpointer's chains of incremental saves (its path's)."""
        return f"Checkpointer {self.path.resolve()}"

    # ---- resume ----

    def resume(self) -> int:
        """Load the newest complete checkpoint (a torn or corrupted one is skipped with a
        warning naming it and why, for the one before) and return the step to start from: the
        steps it holds, 0 without one. Call it once on every trainer before training; the
        first trainer loads the servers' part and the others return once it has."""
        if self._resumed:
            raise RuntimeError("resume() was called already: call it once, before training")
        if self.rank == 0:
            try:
                resumed = self._resume_first()
            except BaseException as e:
                self._open(_Resumed(0, None, f"{type(e).__name__}: {e}"))
                raise
            self._open(resumed)
        else:
            resumed = rpc.rpc_sync(self.trainers[0], _wait_resumed, args=(self._key, self.timeout),
                                   timeout=self.timeout + 30)
            if resumed.error is not None:
                raise RuntimeError(f"{self.trainers[0]} could not resume from {self.path}: {resumed.error}")
            if resumed.directory is not None:
                self._load_mine(torch.load(self.path / resumed.directory / _trainer_file(self.rank),
                                           weights_only=False))
        self._resumed = True
        self.step_index = resumed.step
        return resumed.step

    def _open(self, resumed: _Resumed) -> None:
        if len(self.trainers) > 1:
            gate = _gate(self._key)
            gate.resumed = resumed
            gate.opened.set()

    def _resume_first(self) -> _Resumed:
        """The first trainer's resume: stale staging directories removed, the newest loadable
        checkpoint found and loaded."""
        self.path.mkdir(parents=True, exist_ok=True)
        # a checkpointer of this path left behind in this process (stopped without close(), as a
        # killed job is) finishes the completions it began first: they would race with what follows
        for other in list(_checkpointers):
            if other is not self and other.path.resolve() == self.path.resolve():
                other._drain_quietly()
        for p in self.path.iterdir():
            if p.is_dir() and _STAGING.match(p.name):
                shutil.rmtree(p, ignore_errors=True)  # torn by a kill: never completed
        refused = []
        for step, directory in reversed(complete_checkpoints(self.path)):
            why = _unloadable(directory, step, self._count)
            mine = None
            if why is None:
                try:
                    mine = torch.load(directory / _trainer_file(0), weights_only=False)
                except Exception as e:  # (checksums held: an unpickling error is a bug's, but said the same)
                    why = f"{_trainer_file(0)} does not load ({type(e).__name__}: {e})"
            if why is None:
                try:
                    _load_ps(directory, self.ps)  # (tables first: a CheckpointError there loaded nothing)
                except CheckpointError as e:
                    why = str(e)
            if why is not None:
                warnings.warn(f"checkpoint {directory} is not loadable: {why}; trying the one before it",
                              RuntimeWarning, stacklevel=3)
                refused.append(f"{directory.name}: {why}")
                continue
            self._load_mine(mine)  # (after the servers' part: this trainer's ps_optimizer settings win)
            return _Resumed(step, directory.name, None)
        if refused:
            # (a base removed by hand, a cleanup keeping the newest few, say: put back, it resumes)
            chained = any("is an incremental save on" in why for why in refused)
            hint = (": a base named above must stay where and as it was saved (put back one removed by hand; keep= "
                    "already keeps the bases of the checkpoints it keeps), or" if chained else ":")
            raise RuntimeError(f"no checkpoint under {self.path} is loadable ({'; '.join(refused)}){hint} move them "
                               "away to start afresh")
        return _Resumed(0, None, None)

    def _load_mine(self, saved: Mapping[str, Any]) -> None:
        missing = sorted(set(self.local) - set(saved["local"]))
        if missing:
            raise KeyError(f"the checkpoint has no local state {missing} for trainer {self.rank} (it has "
                           f"{sorted(saved['local'])}): pass the same local= names as the job that saved it")
        for name, obj in self.local.items():
            _load_into(obj, saved["local"][name])
        _set_ps_settings(self.ps, saved.get("ps_settings", {}))
        _set_rng_state(saved["rng"])

    # ---- saving ----

    def step(self) -> Path | None:
        """One training step is done: every ``every_steps`` steps, save. Returns the staging
        directory of a checkpoint started now (complete once every trainer's file is in), else
        None. The first trainer completes the checkpoints whose files are all in here."""
        if not self._resumed:
            raise RuntimeError("call resume() once before training (it returns the step to start from)")
        if self._closed[0]:
            raise RuntimeError(f"this Checkpointer of {self.path} was closed: it saves no more")
        self.step_index += 1
        started = self.save() if self.step_index % self.every_steps == 0 else None
        if started is None:
            self._finish(wait=False)
        return started

    def save(self) -> Path:
        """Save now, at :attr:`step_index` (every trainer calls it at the same step): this
        trainer's file, and on the first trainer the servers' part. Returns the staging
        directory; the checkpoint is visible once complete (see the module's docstring). A second
        call at the same step does nothing."""
        if not self._resumed:
            raise RuntimeError("call resume() once before saving")
        if self._closed[0]:
            raise RuntimeError(f"this Checkpointer of {self.path} was closed: it saves no more")
        step = self.step_index
        staging = self.path / f".{STEP_DIR.format(step)}.tmp"
        if self._saved == step:  # (save() and step() at the same step: once)
            return staging
        self._saved = step
        began = time.perf_counter()
        if self.rank == 0:  # the one before complete first: the servers hold one snapshot at a time
            self._finish(wait=True)
            self._drain()
        staging.mkdir(parents=True, exist_ok=True)
        now = time.monotonic()
        # (the next snapshot into it is the next full save's: full_every saves from now)
        keep_s = KEEP_SNAPSHOT_MIN_S if self._saved_at is None else max(
            KEEP_SNAPSHOT_MIN_S, 3 * (now - self._saved_at) * self.full_every)
        self._saved_at = now
        begun = None
        if self.rank == 0:
            base = self._base if self.full_every > 1 and 0 < self._chained < self.full_every else None
            if base is not None and not _chain_reads(base):  # (it no longer loads: this one whole)
                warnings.warn(f"checkpoint {base} no longer loads: the checkpoint of step {step} is saved whole, not "
                              "incremental on it", RuntimeWarning, stacklevel=2)
                base = None
            # (set before the servers begin: a save that fails to begin leaves the next one whole)
            self._base, self._chained = None, (self._chained + 1 if base is not None else 1)
            begun = _begin_ps(staging, self.ps, self.timeout, keep_snapshot_s=keep_s,
                              token=self._token if self.full_every > 1 else None, base=base)
            self._figures["incremental"] += base is not None
        mine = {"step": step, "local": {name: _state_of(obj) for name, obj in self.local.items()},
                "ps_settings": _ps_settings(self.ps), "rng": _rng_state()}
        # (not fsynced here: the first trainer fsyncs every file before it writes the manifest)
        _write_bytes(staging / _trainer_file(self.rank), save_bytes(mine), fsync=False)
        if self.rank == 0:
            with self._lock:
                self._pending.append(_Pending(step, staging, time.monotonic(), begun))
            if begun is not None:
                begun.add_done_callback(self._servers_wrote)
            self._finish(wait=False)
        self._figures["saves"] += 1
        self._figures["save_s"] += time.perf_counter() - began
        return staging

    def stats(self) -> dict[str, Any]:
        """This trainer's saving so far: ``saves`` (started here), ``save_s`` (seconds spent in
        them: training waited that long, for the servers' snapshot and this trainer's own
        file), ``incremental`` (saves begun as incremental ones, ``full_every``), and on the
        first trainer ``completed`` (checkpoints made visible), ``bytes`` (the
        newest one's files, the servers' shard files among them, summed before its manifest is
        written; None before one) and ``write_s`` (seconds the servers took to write the newest
        one's tables in the background, from their snapshot; None without tables).

        Example::

            ckpt.stats()   # {"saves": 20, "save_s": 1.9, "completed": 20, "bytes": 71295433, "write_s": 0.41,
                           #  "incremental": 0}
        """
        return dict(self._figures)

    def close(self) -> None:
        """Complete the checkpoints started (the first trainer waits, at most ``timeout``
        seconds, for every trainer's file and the servers' writes, then for their completion;
        the others return at once). The checkpointer saves no more: ``step()`` and ``save()``
        raise after it; a second ``close()`` does nothing. The servers free the snapshot
        memory they kept for its next save (and, with ``full_every`` > 1, the ids they dropped,
        kept for its next incremental save)."""
        if self._closed[0]:
            return
        self._finish(wait=True)
        self._drain()
        self._closed[0] = True
        self._completer.shutdown(wait=False)
        if self.rank == 0 and self.ps and self._saved is not None:
            release_snapshot_memory(self.ps, self.timeout)
            if self.full_every > 1:  # (the servers keep the ids they drop for this chain no more)
                end_save_chain(self.ps, self._token, self.timeout)

    def _drain(self) -> None:
        """Wait for the completions handed to the background (each bounded: its waits are), and
        raise the first that failed."""
        while True:
            with self._lock:
                if not self._completing:
                    return
                first = self._completing[0]
            first.exception()  # (waits for it; _check_completed raises what failed)
            self._check_completed()

    def _drain_quietly(self) -> None:
        """Wait for the completions handed to the background (each bounded), whatever their
        outcome: another checkpointer of this path is resuming in this process."""
        with self._lock:
            begun = list(self._completing)
        for done in begun:
            try:
                done.result()
            except BaseException:  # noqa: BLE001 - its own step() or close() would have raised it
                pass

    def _check_completed(self) -> None:
        """Raise the failure of a completion done in the background (the first; each failed
        checkpoint stays incomplete, never loaded)."""
        while True:
            with self._lock:
                if not (self._completing and self._completing[0].done()):
                    return
                failed = self._completing.pop(0).exception()
            if failed is not None:
                raise failed

    def _hand_over(self, pending: _Pending) -> None:
        """(Lock held) complete ``pending`` in the background, first popped off the pending ones."""
        self._pending.pop(0)
        self._completing.append(self._completer.submit(self._complete, pending))

    def _ready(self, pending: _Pending) -> tuple[list[int], bool]:
        """The trainers whose file of ``pending`` is not there yet, and whether its servers wrote."""
        missing = [r for r in range(self._count) if not (pending.staging / _trainer_file(r)).is_file()]
        return missing, pending.ps is None or pending.ps.done()

    def _servers_wrote(self) -> None:
        """(A servers' write finished: on an RPC thread) hand the checkpoints that are ready
        now to the background, not waiting for the next ``step()``."""
        try:
            with self._lock:
                while self._pending and not self._closed[0]:
                    missing, written = self._ready(self._pending[0])
                    if missing or not written:
                        return
                    self._hand_over(self._pending[0])
        except Exception:  # noqa: BLE001 - the next step() sees the same and raises it
            pass

    def _finish(self, wait: bool) -> None:
        """(First trainer) hand each pending checkpoint whose trainers' files are all in and
        whose servers have written theirs to the background, where it is completed
        (:meth:`_complete`; also done as soon as the servers have written); ``wait``: for them,
        within ``timeout``. A checkpoint still missing a trainer's file ``timeout`` seconds after
        it started raises ``TimeoutError`` naming the trainers; a server's failed or late write
        raises what failed (at the step after the background saw it). Either way that
        checkpoint stays incomplete, never loaded."""
        self._check_completed()
        while True:
            with self._lock:
                if not self._pending:
                    return
                pending = self._pending[0]
                missing, written = self._ready(pending)
                if not missing and (written or wait):  # (waiting: the servers' writes are bounded by their timeout)
                    self._hand_over(pending)
                    continue
                if time.monotonic() > pending.since + self.timeout:
                    names = [self.trainers[r] if self.trainers else f"trainer {r}" for r in missing]
                    self._pending.pop(0)
                    raise TimeoutError(f"checkpoint of step {pending.step} in {pending.staging}: no state from "
                                       f"{', '.join(names)} within {self.timeout:g} s (did it stop, or is it that "
                                       "far behind?); the checkpoint stays incomplete and is never loaded")
            if not wait:
                return
            time.sleep(_POLL_S)

    def _complete(self, pending: _Pending) -> None:
        """(In the background, one after another) the servers' part completed (their manifest),
        the trainers' files fsynced, the manifest written last, the staging directory renamed:
        visible now. Then the checkpoints beyond ``keep`` are removed."""
        if pending.ps is not None:
            try:
                pending.ps.wait()
            except BaseException as e:
                raise RuntimeError(f"checkpoint of step {pending.step} in {pending.staging}: the servers' save "
                                   f"of the tables failed ({type(e).__name__}: {e}); the checkpoint stays "
                                   "incomplete and is never loaded") from e
            self._figures["write_s"] = pending.ps.write_s
        staging = pending.staging
        files = {}
        for p in _files(staging):  # (the trainers wrote theirs unsynced: durable before the manifest)
            with open(p, "rb") as f:
                os.fsync(f.fileno())
            files[p.relative_to(staging).as_posix()] = {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
        self._figures["bytes"] = sum(p.stat().st_size for p in staging.rglob("*") if p.is_file())  # (the shards')
        manifest = {"format": FORMAT, "step": pending.step, "trainers": self._count, "files": files}
        part = staging / (MANIFEST + ".part")
        with open(part, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, staging / MANIFEST)
        sync_directory(staging)
        final = self.path / STEP_DIR.format(pending.step)
        if final.exists():  # one that resume() refused (torn or corrupted), of a step trained again since
            shutil.rmtree(final)
        os.rename(staging, final)
        sync_directory(self.path)
        self._figures["completed"] += 1
        if pending.ps is not None:  # (the next save's base, while its chain is shorter than full_every)
            self._base = final
        # the newest up to this one (a newer one is left from before a resume that refused it, as it
        # refuses every save of a chain after a damaged one: this job saves its step again)
        kept = [(s, d) for s, d in complete_checkpoints(self.path) if s <= pending.step]
        needed = _bases_of([d for _, d in kept[-self.keep:]])
        for _, old in kept[:-self.keep]:
            if old.resolve() not in needed:  # (kept while a kept checkpoint is an incremental save on it)
                shutil.rmtree(old, ignore_errors=True)


def _ps_chain(directory: Path) -> list[tuple[str, dict]] | None:
    """The ``ps/`` of checkpoint ``directory`` and the saves it is incremental on, oldest first
    (``read_chain``); None where it or a link does not read (none, torn, a broken chain)."""
    try:
        return read_chain(str(directory / PS_DIR), read_manifest(str(directory / PS_DIR)))
    except (CheckpointError, OSError):
        return None


def _chain_reads(directory: Path) -> bool:
    """Whether the ``ps/`` of checkpoint ``directory`` and the chain it is incremental on read
    (an incremental save on it would load)."""
    return _ps_chain(directory) is not None


def _bases_of(checkpoints: list[Path]) -> set[Path]:
    """The checkpoints (directories, resolved) that ``checkpoints`` are incremental saves on,
    directly or through others: a load of one reads them (one whose chain does not read keeps
    nothing: it does not load whatever is kept)."""
    needed = set()
    for directory in checkpoints:
        links = _ps_chain(directory) or []
        needed.update(Path(at).parent.resolve() for at, _ in links[:-1])
    return needed


def _warn_unclosed(pending: list, closed: list, path: str) -> None:
    """(A first trainer's checkpointer gone or the interpreter ending) say which checkpoints a
    checkpointer never closed left incomplete."""
    if pending and not closed[0]:
        warnings.warn(f"a Checkpointer of {path} was not closed: the checkpoint(s) of step(s) "
                      f"{', '.join(str(p.step) for p in pending)} were never completed (call close() at the end)",
                      RuntimeWarning, stacklevel=1)


def _default_trainers() -> list[str]:
    """The ``"trainer"`` role's workers of the world rpc_backend formed; ``[]`` without an RPC
    world (this process is the only trainer); in any other world, ``trainers`` must be given
    (a ``ValueError`` says so: each trainer taking itself for the only one would overwrite the
    others' files)."""
    from rpc_backend import current_worker

    try:
        me = current_worker()
    except RuntimeError:
        me = None
    if me is not None and me.role == "trainer":
        return me.workers("trainer")
    if rpc.is_available() and _in_rpc_world():
        role = f"has the role {me.role!r}" if me is not None else "was not formed by rpc_backend"
        raise ValueError(f"this RPC world {role}, so which workers are the trainers is not known: pass "
                         "trainers=[every trainer's worker name], in the same order on each")
    return []


def _in_rpc_world() -> bool:
    try:
        rpc.get_worker_info()
    except RuntimeError:
        return False
    return True
