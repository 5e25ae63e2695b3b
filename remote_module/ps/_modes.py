"""The parameter-server modes, written once for dense jobs (``dense._server``) and sharded
tables (``tables.server``).

- :data:`PS_MODES`: ``sync``, ``async``, ``half_async``, ``geo``.
- :class:`SyncSteps` (``sync``): a step is applied once every one of ``num_trainers`` trainers
  has pushed it, their pushes taken in trainer-name order (so every run gives the same bits);
  pushing the step a trainer pushed last again (the retry of a ``step()`` that failed on another
  server after this push arrived) is a no-op; a push for another step is refused, or, where the
  job or table allows it, a push for the step right after the trainer's last one waits for its step.
  Reads (pulls, lookups) for a later step wait, without holding an RPC thread, and fail at
  their deadline naming the trainers that have not pushed (:func:`fail_stalled`). A step the
  optimizer refuses (the trainers' settings disagree) fails every trainer: a job's at its push,
  which waits for the step; a table's is skipped and each trainer is told at its next lookup
  (``skip_refused``, :class:`StepRefusal`).
- :class:`HalfAsyncMerges` (``half_async``): what the job or table queued is applied together once
  ``merge_every`` pushes have arrived or ``merge_s`` seconds have passed since the first
  queued one.
- ``async`` (each push applied on arrival) and ``geo`` (deltas added divided by the number of
  trainers) need no state of their own.

The served object (a job or a table on this server: ``served`` below) keeps its values and
optimizers, and one lock, a ``threading.Condition``, held by every method here that says "lock
held".

Example (a served object's push handler, lock held; ``apply`` steps the optimizers)::

    self.sync = SyncSteps(self, num_trainers=2, allow_ahead=False)
    ...
    with self.lock:
        self.sync.push(trainer, step, grads, None, apply=lambda pushes: self.apply(total(pushes)),
                       refused=lambda: RuntimeError("wrong step"))
        answers = self.sync.ready()
    settle(answers)
"""

from __future__ import annotations

import math
import re
import threading
import time
from typing import Any, Callable

import torch.distributed.rpc as rpc
from torch.futures import Future

from remote_module._core import CallTimeout, complete, schedule, settle_elsewhere

PS_MODES = ("sync", "async", "half_async", "geo")

#: What every message naming a step by its number says with it: the servers number a job's or a
#: table's steps from 0, so "step 2" is the third (a trainer's third step() of a fresh job).
STEPS_FROM_0 = "counting steps from 0"

_clock = time.monotonic


def fail_stalled(future: Future, what: str, noun: str, step: int, missing: list[str], never: int,
                 num_trainers: int) -> None:
    """Fail a sync wait for ``step`` that reached its deadline, on a settler thread, with a
    ``CallTimeout`` naming the trainers that have not pushed it (``missing``) and how many
    never attached (``never``); ``what`` names the job or table, ``noun`` says which."""
    who = ", ".join(repr(t) for t in missing) or "none of the attached trainers"
    if never > 0:
        who += f" (and {never} trainer(s) never attached)"
    error = CallTimeout(
        f"{what} on server {rpc.get_worker_info().name!r}: step {step} ({STEPS_FROM_0}) was not applied in time; "
        f"waiting for gradients from {who} (sync mode needs all {num_trainers} trainers every step: a trainer "
        f"that died or stopped pushing stalls the {noun})"
    )
    settle_elsewhere([lambda: complete(future, error, True)])


def settle(answers: list[tuple[Future, Any, bool]]) -> None:
    """Complete waiting reads with their values or errors (outside the served object's lock:
    completing runs the answers' callbacks)."""
    for future, value, is_error in answers:
        complete(future, value, is_error)


class StepRefusal(Exception):
    """A sync table step the servers refused (:class:`StepRefused`, :class:`StepNotApplied`):
    raised at each trainer's next lookup of the table (see :meth:`SyncSteps.check_told`)."""


class StepRefused(StepRefusal, ValueError):
    """A sync table step refused for a bad value (the trainers' optimizer settings disagree)."""


class StepNotApplied(StepRefusal, RuntimeError):
    """A sync table step whose optimizer step raised something else than a ``ValueError``."""


def refusals_told(error: BaseException, label: str) -> int:
    """How many refusals of the table ``label`` names (``"sharded table 'x'"``) ``error`` (a
    :class:`StepRefusal`, as the trainer re-raised it) tells of: the highest count one of its
    servers gave; 0 if it names none of that table's."""
    counts = re.findall(re.escape(label) + r" on server '[^']*': step \d+ \(" + re.escape(STEPS_FROM_0)
                        + r"\) was refused \(refusal (\d+)\)", str(error))
    return max((int(n) for n in counts), default=0)


class _Waiting:
    """A sync read waiting for its step, failed at its deadline with who has not pushed."""

    __slots__ = ("sync", "step", "future", "read", "seen", "__weakref__")

    def __init__(self, sync: SyncSteps, step: int, future: Future, read: Callable[[], Any],
                 seen: int | None = None) -> None:
        self.sync, self.step, self.future, self.read, self.seen = sync, step, future, read, seen

    def expire(self, now: float) -> None:
        sync = self.sync
        served = sync.served
        with served.lock:
            if self not in sync.waiters:
                return  # answered
            sync.waiters.remove(self)
            missing = sorted(set(served.trainers) - set(sync.pushed)) if sync.done == self.step - 1 else []
            never = sync.num_trainers - len(served.trainers)
        fail_stalled(self.future, served.label, served.noun, self.step - 1, missing, never, sync.num_trainers)


class SyncSteps:
    """The sync mode's steps of one served object (a job or a table on this server).

    The served object provides ``lock``, ``trainers`` (the attached ones), ``label``
    (``"sharded table 'x'"``) and ``noun`` (``"table"``). ``allow_ahead``: a trainer's push for
    the step right after its last one, before the served object completed that last step, waits
    for its step (a table's trainer that looked nothing up in between did not wait); otherwise
    it is refused.

    ``skip_refused`` (a table's): a step whose ``apply`` raises (the trainers' settings
    disagree, say) is skipped: its pushes are dropped, it is no optimizer step, and the next
    step is the next one every trainer pushes (each trainer's step counts on as if it were
    applied, so nothing waits for it); every trainer learns of it at its next read, which
    carries how many refusals it was told of (``seen``) and fails with the refusal until it
    was told of this one (:meth:`check_told`). Otherwise (a job's, whose pushes wait for their
    step, so that every trainer hears of it then) the step's pushes are dropped and every
    trainer pushes it again."""

    def __init__(self, served: Any, num_trainers: int, allow_ahead: bool, skip_refused: bool = False) -> None:
        self.served, self.num_trainers, self.allow_ahead = served, num_trainers, allow_ahead
        self.skip_refused = skip_refused
        self.refusals = 0  # steps skipped (skip_refused)
        self.refusal = ""  # the message of the last one
        self.refusal_type: type = StepRefused  # its type: StepRefused for a ValueError, else StepNotApplied
        self.done = 0  # steps applied
        self.pushed: dict[str, Any] = {}  # this step's pushes by trainer
        self.ahead: dict[int, dict[str, Any]] = {}  # pushes for later steps, by step
        self.last_push: dict[str, tuple[int, Any]] = {}  # each trainer's last (step, token)
        self.waiters: list[_Waiting] = []  # reads for a later step
        self.failed: list[tuple[Future, Any, bool]] = []  # reads failed by a step that could not be applied

    def push(self, trainer: str, step: int, payload: Any, token: Any,
             apply: Callable[[list[tuple[str, Any]]], None], refused: Callable[[], Exception]) -> None:
        """``trainer``'s push of ``step`` (lock held). Each step every trainer has pushed is
        applied, in order, with ``apply(pushes)`` (``(trainer, payload)`` in trainer-name order)
        before the step counts as done. ``refused()`` is raised for a push of another step."""
        last = self.last_push.get(trainer)
        if last == (step, token) and (step in (self.done, self.done - 1) or trainer in self.ahead.get(step, {})):
            return  # a retry: this push is already counted (pending, waiting for its step, or applied)
        after_last = last is not None and last[0] == step - 1
        if step < self.done or (step > self.done and not (self.allow_ahead and after_last)):
            raise refused()
        self.last_push[trainer] = (step, token)
        if step > self.done:
            self.ahead.setdefault(step, {})[trainer] = payload  # waits here for its own step
            return
        self.pushed[trainer] = payload
        while len(self.pushed) == self.num_trainers:
            try:
                apply([(t, self.pushed[t]) for t in sorted(self.pushed)])
            except BaseException as exc:
                if not self.skip_refused:
                    raise self._not_applied(exc) from exc
                self._skipped(exc)
            self.done += 1
            self.pushed = self.ahead.pop(self.done, {})

    def resumes_at(self, trainer: str) -> int:
        """The step ``trainer`` attaching again (its object built again) goes on at: the next
        step to apply, or the one after its last push if that push is counted and its step not
        applied yet (other trainers have not pushed it: its earlier object's last step, whose
        answer that object did not wait for; pushed again, it would be taken as a retry and its
        gradients dropped). Lock held."""
        last = self.last_push.get(trainer)
        return self.done if last is None else max(self.done, last[0] + 1)

    def push_counted(self, trainer: str, step: int, payload: Any, token: Any,
                     apply: Callable[[list[tuple[str, Any]]], None], refused: Callable[[], Exception]
                     ) -> tuple[list[tuple[Future, Any, bool]], BaseException | None]:
        """:meth:`push` (lock held), and what it made ready (:meth:`ready`: the reads to
        :func:`settle` once the lock is released), with the push's failure to raise after them,
        or None: the reads a step not applied failed are answered all the same."""
        error: BaseException | None = None
        try:
            self.push(trainer, step, payload, token, apply, refused)
        except BaseException as exc:
            error = exc
        return self.ready(), error

    def _skipped(self, exc: BaseException) -> None:
        """(``skip_refused``) step ``done`` could not be applied: count it as a refusal, and fail
        the reads waiting that carry a count of refusals below it (their trainer was not told of
        this one yet, by this server or another) with it (lock held; the caller drops the step's
        pushes and goes on to the next step; :meth:`ready` hands those failures out)."""
        self.refusals += 1
        self.refusal_type = StepRefused if isinstance(exc, ValueError) else StepNotApplied
        partly = "" if isinstance(exc, ValueError) else " (the optimizer may have applied part of it before it raised)"
        self.refusal = (
            f"{self.served.label} on server {rpc.get_worker_info().name!r}: step {self.done} ({STEPS_FROM_0}) was "
            f"refused (refusal {self.refusals}): {type(exc).__name__}: {exc}. Its pushes are dropped and it is no "
            f"optimizer step{partly} (as a local optimizer.step() that raised, then zero_grad()); every trainer "
            f"gets this error at its next lookup of the table, and its next step() is the table's next step (fix "
            f"what the error names first)")
        # (a trainer told of this step's refusal by another server of the table already, its
        # read sent since with that count, goes on: told once, as check_told does it)
        untold = [w for w in self.waiters if w.seen is not None and w.seen < self.refusals]
        self.waiters = [w for w in self.waiters if w.seen is None or w.seen >= self.refusals]
        self.failed += [(w.future, self._refusal_error(), True) for w in untold]

    def _refusal_error(self) -> Exception:
        return self.refusal_type(self.refusal)

    def check_told(self, seen: int | None) -> None:
        """(``skip_refused``) a read of a trainer told of ``seen`` refusals (None: a read that
        needs no telling, a checkpoint's): the last refusal, if it was not told of it (lock
        held)."""
        if seen is not None and seen < self.refusals:
            raise self._refusal_error()

    def _not_applied(self, exc: BaseException) -> Exception:
        """Step ``done`` could not be applied (``apply`` raised: the optimizer refused it): its
        pushes are dropped, so every trainer may push it again (a retry is not taken for a
        repeat), and the reads waiting for it fail with the error, as the pusher that completed
        it does, instead of waiting for a step that would never come (lock held; :meth:`ready`
        hands those failures out). A ``ValueError`` (a bad value: the trainers' optimizer
        settings disagree, say) stays one; anything else is a ``RuntimeError``."""
        step = self.done
        error = (ValueError if isinstance(exc, ValueError) else RuntimeError)(
            f"{self.served.label}: applying step {step} failed ({STEPS_FROM_0}; {type(exc).__name__}: {exc}); its "
            f"pushes are dropped (the optimizer may have applied part of it, as a local optimizer.step() that "
            f"raises may): every trainer's step() pushes it again")
        for trainer in self.pushed:
            if self.last_push.get(trainer, (None,))[0] == step:
                del self.last_push[trainer]
        self.pushed = {}
        waiting = [w for w in self.waiters if w.step == step + 1]
        self.waiters = [w for w in self.waiters if w.step != step + 1]
        self.failed += [(w.future, error, True) for w in waiting]
        return error

    def wait(self, step: int, future: Future, read: Callable[[], Any], seconds: float, seen: int | None = None
             ) -> bool:
        """Whether a read for ``step`` must wait (lock held); if so it is queued and answered
        with ``read()`` by :meth:`ready` once step ``step - 1`` is applied, or failed after
        ``seconds`` (``seen``: :meth:`check_told`'s, checked first)."""
        self.check_told(seen)
        if self.done >= step:
            return False
        waiting = _Waiting(self, step, future, read, seen)
        self.waiters.append(waiting)  # holds it: the watcher holds it only weakly
        if seconds != math.inf:
            schedule(_clock() + seconds, waiting)
        return True

    def ready(self) -> list[tuple[Future, Any, bool]]:
        """The waiting reads whose step is applied, with their values (each read's ``read()``) or the
        error it raised (that read's own: a read of blocks or rows not held here fails alone,
        never the push that completed the step nor the other reads) (lock held); :func:`settle`
        them outside the lock."""
        failed, self.failed = self.failed, []
        ready = [w for w in self.waiters if self.done >= w.step]
        if not ready:
            return failed
        self.waiters = [w for w in self.waiters if self.done < w.step]
        answers = failed
        for w in ready:
            try:
                answers.append((w.future, w.read(), False))
            except Exception as exc:
                answers.append((w.future, exc, True))
        return answers


def read_when_applied(served: Any, step: int, seconds: float, answer: Callable[..., Any], *args: Any,
                      seen: int | None = None) -> Future:
    """A read of ``served`` (a pull, a lookup): ``answer(*args)`` now, or in sync mode once step
    ``step - 1`` is applied (failed after ``seconds`` naming the trainers that have not pushed;
    failed with what ``answer`` raises, if it raises; ``seen``: see :meth:`SyncSteps.check_told`)."""
    future: Future = Future()
    with served.lock:
        if served.spec.mode == "sync" and served.sync.wait(step, future, lambda: answer(*args), seconds, seen):
            return future
        value = answer(*args)
    future.set_result(value)
    return future


class HalfAsyncMerges:
    """When the half_async mode applies what its job or table queued: every ``every`` pushes, or
    ``seconds`` after the first push queued since the last merge (``apply_queued()``, lock
    held)."""

    def __init__(self, lock: threading.Condition, every: int, seconds: float,
                 apply_queued: Callable[[], None]) -> None:
        self.lock, self.every, self.seconds, self.apply_queued = lock, every, seconds, apply_queued
        self.count = 0  # pushes queued since the last merge
        self.timer: threading.Timer | None = None
        self.due = math.inf  # when the timer merges (no sooner): its start plus ``seconds``

    def queued(self) -> None:
        """The job or table queued one more push (lock held)."""
        self.count += 1
        if self.count >= self.every:
            self.merge()
        elif self.timer is None:
            self.due = _clock() + self.seconds
            self.timer = threading.Timer(self.seconds, merge_later)
            self.timer.args = (self, self.timer)
            self.timer.daemon = True
            self.timer.start()

    def left(self) -> float:
        """Seconds at least until what is queued is merged unless more pushes come (lock held):
        ``inf`` when nothing is queued."""
        return max(0.0, self.due - _clock()) if self.count else math.inf

    def merge(self) -> None:
        """Apply what is queued now (lock held)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.count:
            self.count = 0
            self.apply_queued()


def merge_later(merges: HalfAsyncMerges, timer: threading.Timer) -> None:
    """A half_async timer's merge (on the timer's thread)."""
    with merges.lock:
        if merges.timer is timer:  # not cancelled (by a count merge) while it waited for the lock
            merges.merge()


class TrainerSettings:
    """The optimizer settings (a trainer's ``ps_optimizer``'s) a server's job or table applies
    its pushes with, written once for both: each trainer's as it last sent them (it sends them
    only when they changed), and :attr:`latest`, those of the latest push (async, half_async:
    its trainer's, never another's; None: the served object's own). All under its lock."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.by_trainer: dict[str, dict] = {}
        self.latest: dict | None = None

    def sent(self, trainer: str, settings: dict) -> None:
        """``trainer``'s settings, for its pushes from now on."""
        self.by_trainer[trainer] = dict(settings)

    def pushed(self, trainer: str) -> None:
        """async, half_async: a push of ``trainer`` arrived; its settings are the latest."""
        if trainer in self.by_trainer:
            self.latest = self.by_trainer[trainer]

    def agreed(self, trainers: list[str]) -> dict | None:
        """sync: the settings ``trainers`` (a step's) last sent, which must be the same:
        ``ValueError`` naming the first setting that differs and every trainer's value."""
        mine = {t: self.by_trainer.get(t) for t in trainers}
        first = next(iter(mine.values()), None)
        for values in mine.values():
            if values == first:
                continue
            keys = sorted(set(values or {}) | set(first or {}))
            key = next(k for k in keys if (values or {}).get(k) != (first or {}).get(k))
            each = ", ".join(f"{who}: {(v or {}).get(key, 'the default')!r}" for who, v in sorted(mine.items()))
            raise ValueError(f"{self.label}: in sync mode every trainer must step with the same optimizer settings, "
                             f"but the trainers' ps_optimizer {key!r} differ ({each})")
        return first


def take_settings(served: Any, trainer: str, settings: dict) -> None:
    """A server's handler of a trainer's optimizer settings (its ``ps_optimizer``'s), for the
    job or table ``served`` (its ``lock`` and :class:`TrainerSettings` ``settings``), for its
    pushes from now on: async and half_async apply each push with its trainer's (a half_async
    merge with the latest push's), another trainer's never; sync, those every trainer of the
    step sent, which must agree."""
    with served.lock:
        served.settings.sent(trainer, settings)  # (its next push makes them the latest: async)


def merge_now(served: Any) -> None:
    """A server's handler of a ``flush()``: half_async, ``served`` (a job or table: its ``lock``
    and :class:`HalfAsyncMerges` ``merges``) applies what it has queued now (e.g. before a
    checkpoint); the other modes queue nothing."""
    with served.lock:
        served.merges.merge()
