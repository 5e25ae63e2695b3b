"""The server side of a parameter-server job: the blocks a server owns, their optimizers, and
how pushed gradients are applied in each mode. Servers run no code of their own: trainers
create this state by RPC (the handlers below), under a job-unique name, idempotently.

Modes (per job, the same on every server):

- ``sync``: step ``k``'s gradients from all ``num_trainers`` trainers are averaged (summed in
  trainer-name order, so every run gives the same bits) and applied once; pulls for step
  ``k + 1`` are answered only after that. A trainer pushing for a step that is not the current
  one is refused; pushing its last step again (the retry of a ``step()`` that failed on another
  server) is a no-op.
- ``async``: each pushed gradient is applied when it arrives, under the job's lock.
- ``half_async``: pushes are queued and summed; the sum is applied once ``merge_every`` pushes
  have arrived or ``merge_s`` seconds have passed since the first queued one.
- ``geo``: trainers push parameter deltas; each is added divided by ``num_trainers``.

Waiting pulls (sync) hold no RPC thread: they are futures completed when the step is applied.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, NamedTuple

import torch
import torch.distributed.rpc as rpc
from torch import nn
from torch.futures import Future

from remote_module._core import CallTimeout, complete, schedule, settle_elsewhere

MODES = ("sync", "async", "half_async", "geo")

_clock = time.monotonic


class JobSpec(NamedTuple):
    """What every trainer of a job must agree on (compared when a trainer attaches)."""

    mode: str
    num_trainers: int
    optimizer: tuple  # (class, kwargs)
    merge_every: int
    merge_s: float
    layout: str  # digest of every block's name, offset, size and server


class _Job:
    def __init__(self, name: str, spec: JobSpec, blocks: dict[str, torch.Tensor]) -> None:
        self.name, self.spec = name, spec
        self.lock = threading.Condition()
        opt_cls, opt_kwargs = spec.optimizer
        self.params: dict[str, nn.Parameter] = {}
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        for block, value in blocks.items():
            value = value.detach().clone().reshape(-1)
            # an integer parameter (never trained, no gradient) cannot require grad
            p = nn.Parameter(value, requires_grad=value.is_floating_point() or value.is_complex())
            self.params[block] = p
            if spec.mode != "geo":
                self.optimizers[block] = opt_cls([p], **opt_kwargs)
        self.trainers: set[str] = set()
        self.version = 0  # sync: steps applied
        self.pushed: dict[str, dict[str, torch.Tensor]] = {}  # sync: this step's pushes by trainer
        self.last_step: dict[str, int] = {}  # sync: the last step each trainer pushed (retries are no-ops)
        self.waiters: list[_Waiting] = []  # sync pulls waiting for a version
        self.queued: dict[str, torch.Tensor] = {}  # half_async: summed pushes not yet applied
        self.queued_count = 0
        self.timer: threading.Timer | None = None
        self.applied = 0  # pushes (or merges) applied, for tests and stats

    # ---- applying -------------------------------------------------------------------

    def apply(self, grads: dict[str, torch.Tensor], scale: float = 1.0) -> None:
        """One optimizer step per block with ``grads * scale`` (lock held)."""
        with torch.no_grad():
            for block, g in grads.items():
                p = self.params[block]
                p.grad = g.reshape(-1).to(p.dtype) * scale if scale != 1.0 else g.reshape(-1).to(p.dtype)
                self.optimizers[block].step()
                p.grad = None
        self.applied += 1

    def values(self, blocks: list[str]) -> list[torch.Tensor]:
        return [self.params[b].detach().clone() for b in blocks]

    def snapshot(self, blocks: list[str], packed: bool) -> Any:
        """The blocks' values (lock held): a list of tensors, or ``packed``: one flat tensor,
        the blocks concatenated in order (one tensor per message: each tensor a message
        carries costs the RPC agent as much as a few hundred KB of data)."""
        if packed:
            return torch.cat([self.params[b].detach() for b in blocks])
        return self.values(blocks)

    def merge(self) -> None:
        """half_async: apply what is queued (lock held)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.queued_count:
            queued, self.queued, self.queued_count = self.queued, {}, 0
            self.apply(queued)


_jobs: dict[str, _Job] = {}
_jobs_lock = threading.Lock()


def _job(name: str) -> _Job:
    job = _jobs.get(name)
    if job is None:
        raise LookupError(
            f"no parameter-server job {name!r} on worker {rpc.get_worker_info().name!r}: create the PSModel "
            "(or table) with this name first"
        )
    return job


def _mismatch(name: str, what: str, mine: Any, theirs: Any) -> ValueError:
    return ValueError(
        f"parameter-server job {name!r}: this trainer's {what} is {theirs!r}, but the job was created with "
        f"{mine!r}; every trainer of a job must use the same {what}"
    )


# ---- handlers ------------------------------------------------------------------------------


def _attach(name: str, spec: JobSpec, trainer: str, blocks: dict[str, torch.Tensor]) -> tuple[bool, int]:
    """Create job ``name`` with ``blocks`` (first trainer) or attach to it: whether it was
    created, and the step the job is at (sync: a trainer that attaches again starts there)."""
    with _jobs_lock:
        job = _jobs.get(name)
        created = job is None
        if created:
            job = _jobs[name] = _Job(name, spec, blocks)
    if not created:
        for field in ("mode", "num_trainers", "merge_every", "merge_s"):
            if getattr(job.spec, field) != getattr(spec, field):
                raise _mismatch(name, field, getattr(job.spec, field), getattr(spec, field))
        if job.spec.layout != spec.layout:
            raise _mismatch(name, "block layout (parameter names, shapes, slicing, servers)",
                            job.spec.layout, spec.layout)
        if (job.spec.optimizer[0], job.spec.optimizer[1]) != (spec.optimizer[0], spec.optimizer[1]):
            raise _mismatch(name, "optimizer", job.spec.optimizer, spec.optimizer)
    with job.lock:
        if trainer not in job.trainers and len(job.trainers) >= job.spec.num_trainers:
            raise ValueError(
                f"parameter-server job {name!r} already has num_trainers={job.spec.num_trainers} trainers "
                f"({sorted(job.trainers)}); trainer {trainer!r} would be one more"
            )
        job.trainers.add(trainer)
        return created, job.version


class _Waiting:
    """A sync pull waiting for its step, failed at its deadline with who has not pushed."""

    __slots__ = ("job", "step", "future", "blocks", "packed", "__weakref__")

    def __init__(self, job: _Job, step: int, future: Future, blocks: list[str]) -> None:
        self.job, self.step, self.future, self.blocks = job, step, future, blocks
        self.packed = False

    def expire(self, now: float) -> None:
        job = self.job
        with job.lock:
            if self not in job.waiters:
                return  # answered
            job.waiters.remove(self)
            missing = sorted(set(job.trainers) - set(job.pushed)) if job.version == self.step - 1 else []
            never = job.spec.num_trainers - len(job.trainers)
        fail_stalled(self.future, f"parameter-server job {job.name!r}", "job", self.step - 1, missing, never,
                     job.spec.num_trainers)


def fail_stalled(future: Future, what: str, noun: str, step: int, missing: list[str], never: int,
                 num_trainers: int) -> None:
    """Fail a sync wait for ``step`` that reached its deadline, on a settler thread, with a
    ``CallTimeout`` naming the trainers that have not pushed it (``missing``) and how many
    never attached (``never``); ``what`` names the job or table, ``noun`` says which."""
    who = ", ".join(repr(t) for t in missing) or "none of the attached trainers"
    if never > 0:
        who += f" (and {never} trainer(s) never attached)"
    error = CallTimeout(
        f"{what} on server {rpc.get_worker_info().name!r}: step {step} was not applied in time; waiting for "
        f"gradients from {who} (sync mode needs all {num_trainers} trainers every step: a trainer that died or "
        f"stopped pushing stalls the {noun})"
    )
    settle_elsewhere([lambda: complete(future, error, True)])


@rpc.functions.async_execution
def _pull(name: str, blocks: list[str], step: int, seconds: float = math.inf, packed: bool = False) -> Future:
    """The current values of ``blocks``; in sync mode, once step ``step - 1`` is applied (a
    pull still waiting after ``seconds`` fails naming the trainers that have not pushed)."""
    job = _job(name)
    answer: Future = Future()
    with job.lock:
        if job.spec.mode == "sync" and job.version < step:
            waiting = _Waiting(job, step, answer, blocks)
            waiting.packed = packed
            job.waiters.append(waiting)  # holds it: the watcher holds it only weakly
            if seconds != math.inf:
                schedule(_clock() + seconds, waiting)
            return answer
        values = job.snapshot(blocks, packed)
    answer.set_result(values)
    return answer


def unpacked(blocks: Any) -> dict[str, torch.Tensor]:
    """Blocks as sent: a dict by block name, or packed as ``(names, sizes, flat)``."""
    if isinstance(blocks, dict):
        return blocks
    names, sizes, flat = blocks
    return dict(zip(names, torch.split(flat, list(sizes))))


def _push(name: str, trainer: str, step: int, grads: Any) -> None:
    """Gradients of this server's blocks from ``trainer`` for ``step``, applied by the job's mode."""
    job = _job(name)
    grads = unpacked(grads)
    ready: list[tuple[Future, list[torch.Tensor]]] = []
    with job.lock:
        mode = job.spec.mode
        if mode == "geo":
            raise ValueError(f"parameter-server job {name!r} is in geo mode: trainers push deltas, not gradients")
        unknown = [b for b in grads if b not in job.params]
        if unknown:
            raise KeyError(f"parameter-server job {name!r} has no blocks {unknown} on this server")
        if mode == "async":
            job.apply(grads)
        elif mode == "half_async":
            for b, g in grads.items():
                job.queued[b] = job.queued[b] + g if b in job.queued else g.clone()
            job.queued_count += 1
            if job.queued_count >= job.spec.merge_every:
                job.merge()
            elif job.timer is None:
                job.timer = threading.Timer(job.spec.merge_s, _merge_later)
                job.timer.args = (job, job.timer)
                job.timer.daemon = True
                job.timer.start()
        else:  # sync
            if job.last_step.get(trainer) == step and step in (job.version, job.version - 1):
                # the retry of a step() that failed elsewhere (e.g. another server timed out) after
                # this push arrived: already counted (pending or applied), so nothing to do
                return
            if step != job.version:
                raise RuntimeError(
                    f"parameter-server job {name!r}: trainer {trainer!r} pushed gradients for step {step}, but the "
                    f"servers are at step {job.version}; in sync mode every trainer pushes once per step, in step"
                )
            job.pushed[trainer] = grads
            job.last_step[trainer] = step
            if len(job.pushed) == job.spec.num_trainers:
                order = sorted(job.pushed)
                total = {}  # a block no trainer has a gradient for is left alone (as torch does)
                for b in job.params:
                    parts = [job.pushed[t][b] for t in order if b in job.pushed[t]]
                    if parts:
                        total[b] = sum(parts[1:], parts[0].clone())
                job.apply(total, 1.0 / job.spec.num_trainers)
                job.pushed = {}
                job.version += 1
                still = []
                for w in job.waiters:
                    if job.version >= w.step:
                        ready.append((w.future, job.snapshot(w.blocks, w.packed)))
                    else:
                        still.append(w)
                job.waiters = still
    for fut, values in ready:  # outside the lock: completing runs the answer's callbacks
        fut.set_result(values)


def _merge_later(job: _Job, timer: threading.Timer) -> None:
    with job.lock:
        if job.timer is timer:  # not cancelled (by a merge) while it waited for the lock
            job.merge()


def _push_delta(name: str, deltas: Any, packed: bool = False) -> Any:
    """geo: add ``delta / num_trainers`` to each block; the merged values."""
    job = _job(name)
    deltas = unpacked(deltas)
    with job.lock, torch.no_grad():
        for b, d in deltas.items():
            job.params[b].add_(d.reshape(-1).to(job.params[b].dtype) / job.spec.num_trainers)
        job.applied += 1
        return job.snapshot(list(deltas), packed)


def _flush(name: str) -> None:
    """half_async: apply what is queued now (e.g. before a checkpoint)."""
    job = _job(name)
    with job.lock:
        if job.spec.mode == "half_async":
            job.merge()


def _set_values(name: str, values: dict[str, torch.Tensor]) -> None:
    job = _job(name)
    with job.lock, torch.no_grad():
        for b, v in values.items():
            job.params[b].copy_(v.reshape(-1))


def _optimizer_state(name: str, blocks: list[str]) -> dict[str, dict]:
    """Each block's optimizer state (``state`` of its one parameter, ``param_groups`` minus params)."""
    job = _job(name)
    with job.lock:
        out = {}
        for b in blocks:
            opt = job.optimizers.get(b)
            if opt is None:
                out[b] = {}
                continue
            sd = opt.state_dict()
            out[b] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd["state"].get(0, {}).items()}
        return out


def _load_optimizer_state(name: str, states: dict[str, dict]) -> None:
    job = _job(name)
    with job.lock:
        for b, state in states.items():
            opt = job.optimizers.get(b)
            if opt is None:
                continue
            sd = opt.state_dict()
            sd["state"] = {0: state} if state else {}
            opt.load_state_dict(sd)


def _stats(name: str) -> dict:
    job = _job(name)
    with job.lock:
        return {"version": job.version, "applied": job.applied, "trainers": sorted(job.trainers),
                "queued": job.queued_count, "blocks": sorted(job.params)}
