"""The server side of a parameter-server job: the blocks a server owns, their optimizers, and
how pushed gradients are applied. Servers run no code of their own: trainers create this state
by RPC (the handlers below), under a job-unique name, idempotently.

The modes (per job, the same on every server) are ``_modes``'s, shared with the tables: ``sync``
averages step ``k``'s gradients of all ``num_trainers`` trainers (summed in trainer-name order)
and applies them once, pulls for step ``k + 1`` waiting for that (a push for any other step
than the current one is refused here); ``async`` applies each push on arrival; ``half_async``
sums pushes and applies the sum every ``merge_every`` pushes or ``merge_s`` seconds; ``geo``
adds each pushed parameter delta divided by ``num_trainers``.
"""

from __future__ import annotations

import math
import threading
from typing import Any, NamedTuple

import torch
import torch.distributed.rpc as rpc
from torch import nn
from torch.futures import Future

from remote_module._core import CallTimeout, HostStore, followed
from remote_module.ps._modes import (
    STEPS_FROM_0,
    HalfAsyncMerges,
    SyncSteps,
    TrainerSettings,
    merge_now,
    read_when_applied,
    settle,
    take_settings,
)
from remote_module.ps._optimizer import set_group


class JobSpec(NamedTuple):
    """What every trainer of a job must agree on (compared when a trainer attaches)."""

    mode: str
    num_trainers: int
    optimizer: tuple  # (class, kwargs)
    merge_every: int
    merge_s: float
    layout: str  # digest of every block's name, offset, size and server
    dc_asgd: float | None = None  # async: delay compensation's lambda (None: off)


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
        self.label, self.noun = f"parameter-server job {name!r}", "job"
        self.sync = SyncSteps(self, spec.num_trainers, allow_ahead=False)
        self.queued: dict[str, torch.Tensor] = {}  # half_async: summed pushes not yet applied
        self.merges = HalfAsyncMerges(self.lock, spec.merge_every, spec.merge_s, self._apply_queued)
        self.applied = 0  # pushes (or merges) applied, for tests and stats
        # dc_asgd: per trainer, each block's value as this server last sent it to that trainer
        # (a pull's or a push's answer): one copy of the blocks here per trainer
        self.sent: dict[str, dict[str, torch.Tensor]] = {}
        # the trainers' optimizer settings (their ps_optimizer's lr, momentum, betas, weight_decay)
        self.settings = TrainerSettings(self.label)

    # ---- applying -------------------------------------------------------------------

    def apply(self, grads: dict[str, torch.Tensor], scale: float = 1.0, settings: dict | None = None) -> None:
        """One optimizer step per block with ``grads * scale`` (lock held), with ``settings``
        (default: the latest push's) in each block's optimizer."""
        settings = self.settings.latest if settings is None else settings
        if settings:
            for block in grads:
                set_group(self.optimizers[block].param_groups[0], settings)
        with torch.no_grad():
            for block, g in grads.items():
                p = self.params[block]
                p.grad = g.reshape(-1).to(p.dtype) * scale if scale != 1.0 else g.reshape(-1).to(p.dtype)
                self.optimizers[block].step()
                p.grad = None
        self.applied += 1

    def values(self, blocks: list[str]) -> list[torch.Tensor]:
        return [self.params[b].detach().clone() for b in blocks]

    def snapshot(self, blocks: list[str], packed: bool | list[int]) -> Any:
        """The blocks' values (lock held): a list of tensors; or ``packed``: ``True``, one
        flat tensor, the blocks concatenated in order (one tensor per message: each tensor a
        message carries costs the RPC agent as much as a few hundred KB of data), or a list of
        block counts, one flat tensor per run of that many blocks (blocks of one dtype each)."""
        if packed is True:
            return torch.cat([self.params[b].detach() for b in blocks])
        if isinstance(packed, list):
            out, at = [], 0
            for n in packed:
                out.append(torch.cat([self.params[b].detach() for b in blocks[at:at + n]]))
                at += n
            return out
        return self.values(blocks)

    def answer(self, trainer: str | None, blocks: list[str], packed: bool | list[int]) -> Any:
        """:meth:`snapshot` sent to ``trainer`` (lock held); with ``dc_asgd``, what it was sent
        is kept for its next push's compensation."""
        if self.spec.dc_asgd is not None and trainer is not None:
            mine = self.sent.setdefault(trainer, {})
            for b in blocks:
                mine[b] = self.params[b].detach().clone()
        return self.snapshot(blocks, packed)

    def compensated(self, trainer: str, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """DC-ASGD (lock held): each gradient ``g`` of ``trainer`` as ``g + lambda * g * g * (w_now -
        w_sent)``, ``w_sent`` the block's value this server last sent that trainer (the values
        its gradient was computed at, unless it changed them since), ``w_now`` the block's value
        now; a block never sent to it is left as it is."""
        lam, mine = self.spec.dc_asgd, self.sent.get(trainer, {})
        out = {}
        for b, g in grads.items():
            w_sent = mine.get(b)
            if w_sent is None:
                out[b] = g
                continue
            p = self.params[b].detach()
            # in float32 at least (float16's lambda * g * g overflows from |g| ~ 256), and g * (w_now
            # - w_sent) first: where nothing changed it is 0, never inf * 0 (NaN)
            work = torch.promote_types(p.dtype, torch.float32)
            g, d = g.reshape(-1).to(p.dtype).to(work), p.to(work) - w_sent.to(work)
            if g.is_complex():  # as torch's optimizers step it: its real and imaginary parts
                g, d = torch.view_as_real(g), torch.view_as_real(d)
            c = g + lam * (g * (g * d))
            out[b] = (torch.view_as_complex(c) if p.is_complex() else c).to(p.dtype)
        return out

    def _apply_queued(self) -> None:
        queued, self.queued = self.queued, {}
        self.apply(queued)

    def apply_step(self, pushes: list[tuple[str, dict[str, torch.Tensor]]]) -> None:
        """sync: one step's pushes (in trainer-name order) averaged and applied (lock held). A
        block no trainer has a gradient for is left alone, as torch does."""
        total = {}
        for b in self.params:
            parts = [grads[b] for _, grads in pushes if b in grads]
            if parts:
                total[b] = sum(parts[1:], parts[0].clone())
        self.apply(total, 1.0 / self.spec.num_trainers, self.settings.agreed([t for t, _ in pushes]))


#: This server's jobs by name (created by the first trainer to attach; they live as long as the
#: server process).
_jobs = HostStore()


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
    job, created = _jobs.setdefault(name, lambda: _Job(name, spec, blocks))
    if not created:
        for field in ("mode", "num_trainers", "merge_every", "merge_s", "dc_asgd"):
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
        return created, job.sync.resumes_at(trainer)


@rpc.functions.async_execution
def _pull(name: str, blocks: list[str], step: int, seconds: float = math.inf, packed: bool = False,
          trainer: str | None = None) -> Future:
    """The current values of ``blocks``; in sync mode, once step ``step - 1`` is applied (a
    pull still waiting after ``seconds`` fails naming the trainers that have not pushed).
    ``trainer``: who pulls (DC-ASGD keeps what it was sent)."""
    job = _job(name)
    return read_when_applied(job, step, seconds, job.answer, trainer, blocks, packed)


def unpacked(blocks: Any) -> dict[str, torch.Tensor]:
    """Blocks as sent: a dict by block name, packed as ``(names, sizes, flat)``, or a list of
    those (blocks of several dtypes: one flat tensor per dtype)."""
    if isinstance(blocks, dict):
        return blocks
    if isinstance(blocks, list):
        out: dict[str, torch.Tensor] = {}
        for part in blocks:
            out.update(unpacked(part))
        return out
    names, sizes, flat = blocks
    return dict(zip(names, torch.split(flat, list(sizes))))


def _push(name: str, trainer: str, step: int, grads: Any, answer: tuple | None = None) -> Any:
    """Gradients of this server's blocks from ``trainer`` for ``step``, applied by the job's
    mode. ``answer`` ``(blocks, packed)`` (async, half_async): answer with those blocks'
    values right after this push, as a pull then would (:meth:`Job.snapshot`), and for how
    many seconds at least a pull would read the same but for other trainers' pushes
    (half_async: until the timer merges what is queued, this push among it; else ``inf``)."""
    job = _job(name)
    grads = unpacked(grads)
    ready: list[tuple[Future, Any, bool]] = []
    error: BaseException | None = None
    with job.lock:
        mode = job.spec.mode
        if mode == "geo":
            raise ValueError(f"parameter-server job {name!r} is in geo mode: trainers push deltas, not gradients")
        unknown = [b for b in grads if b not in job.params]
        if unknown:
            raise KeyError(f"parameter-server job {name!r} has no blocks {unknown} on this server")
        for b, g in grads.items():  # checked before the push counts: a bad one must not stall a step
            if g.numel() != job.params[b].numel():
                raise ValueError(
                    f"parameter-server job {name!r}: trainer {trainer!r} pushed {g.numel()} gradient values for "
                    f"block {b!r}, which holds {job.params[b].numel()} on this server"
                )
        if mode != "sync":
            job.settings.pushed(trainer)
        if mode == "async":
            job.apply(grads if job.spec.dc_asgd is None else job.compensated(trainer, grads))
            return None if answer is None else (job.answer(trainer, *answer), math.inf)
        elif mode == "half_async":
            for b, g in grads.items():
                job.queued[b] = job.queued[b] + g if b in job.queued else g.clone()
            job.merges.queued()
            return None if answer is None else (job.snapshot(*answer), job.merges.left())
        else:  # sync
            ready, error = job.sync.push_counted(trainer, step, grads, None, job.apply_step, lambda: RuntimeError(
                f"parameter-server job {name!r}: trainer {trainer!r} pushed gradients for step {step}, but the "
                f"servers are at step {job.sync.done} ({STEPS_FROM_0}); in sync mode every trainer pushes once per "
                "step, in step"))
    settle(ready)
    if error is not None:
        raise error
    return None


@rpc.functions.async_execution
def _push_applied(name: str, trainer: str, step: int, grads: Any, answer: tuple, seconds: float = math.inf
                  ) -> Future:
    """sync: :func:`_push`, answered once ``step`` is applied (every trainer pushed it) with
    ``answer``'s blocks' values then, as a pull for the next step would see them, and
    ``inf`` (no other push changes them before this trainer's next one): ``(values, inf)``.
    If the step is not applied within ``seconds`` the push still counts (the step is applied
    once the missing trainers push) and the answer is ``(None, message)``, the message naming
    those trainers, for the trainer to raise as a read that timed out: pushing again would be
    a retry, which changes nothing."""
    job = _job(name)
    if job.spec.mode != "sync":
        raise ValueError(f"parameter-server job {name!r} is in {job.spec.mode} mode: _push_applied is sync's")
    _push(name, trainer, step, grads)
    # (followed, not then(): a step's ValueError, the trainers' settings disagreeing, stays one)
    return followed(read_when_applied(job, step + 1, seconds, _applied_values, job, answer), _stalled_as_answer)


def _applied_values(job: _Job, answer: tuple) -> tuple[Any, float]:
    return job.snapshot(*answer), math.inf


def _stalled_as_answer(fut: Future) -> tuple[Any, Any]:
    try:
        return fut.value()
    except CallTimeout as exc:  # the step not applied in time (the push itself counted)
        return None, str(exc)


def _push_delta(name: str, deltas: Any, packed: bool = False) -> Any:
    """geo: add ``delta / num_trainers`` to each block; the merged values."""
    job = _job(name)
    deltas = unpacked(deltas)
    with job.lock, torch.no_grad():
        for b, d in deltas.items():
            job.params[b].add_(d.reshape(-1).to(job.params[b].dtype) / job.spec.num_trainers)
        job.applied += 1
        return job.snapshot(list(deltas), packed)


def _set_settings(name: str, trainer: str, settings: dict) -> None:
    """``trainer``'s optimizer settings for job ``name`` (:func:`take_settings`)."""
    take_settings(_job(name), trainer, settings)


def _flush(name: str) -> None:
    """half_async: job ``name`` applies what is queued now (:func:`merge_now`)."""
    merge_now(_job(name))


def _set_values(name: str, values: dict[str, torch.Tensor]) -> None:
    """Load ``values`` (a checkpoint). DC-ASGD: each trainer's ``w_sent`` of those blocks
    becomes the loaded value, so a gradient computed before the load is applied to the loaded
    values as it is (as torch's optimizer after a load), then compensated only for what other
    trainers change after the load."""
    job = _job(name)
    with job.lock, torch.no_grad():
        for b, v in values.items():
            job.params[b].copy_(v.reshape(-1))
            for mine in job.sent.values():
                if b in mine:
                    mine[b] = job.params[b].detach().clone()


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
        return {"version": job.sync.done, "applied": job.applied, "trainers": sorted(job.trainers),
                "queued": job.merges.count, "blocks": sorted(job.params)}
