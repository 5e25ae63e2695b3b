"""Prefetch: a table's or collection's lookup planned ahead of its forward and sent with a
step's pushes (:class:`Prefetch`), and the prefetches of one table or collection in the order
of the forwards they are for, with those ``prefetching`` plans after the next step
(:class:`PrefetchQueue`)."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

from remote_module.ps._steps import PushPlan, SentPushes, send_push_plans
from remote_module.ps.tables._lookups import at_step
from remote_module.ps.tables.server import _handlers
from remote_module.ps.tables.server._requests import UnlessMerged


class Prefetch:
    """A lookup planned ahead by ``prefetch()``: the next forward with equal arguments (by
    value) consumes it; it is sent with the next ``step()``'s pushes (one message per server:
    the servers answer it once they applied them), or at that forward.

    With ``overlap`` (``prefetching(..., overlap=True)``, async mode) it may be sent one step
    earlier, with the step before the next forward's: it then misses that forward's last push.
    A prefetch not consumed by the forward it was planned for is dropped.

    half_async: the forward uses it only if it reflects every merge the servers finished before
    that forward began (:meth:`PrefetchQueue.claim`); each server answers, ahead of its lookups, its
    merge count and how long at least before its timer merges (:func:`_handlers._merge_state`)."""

    def __init__(self, key: tuple, records: Any, calls: list, finish: Callable[[list], Any],
                 replan: bool = False, tables: Sequence = (), overlap: bool = False) -> None:
        # a copy of each tensor, compared by value with the forward's (the caller may change it
        # in place meanwhile), in one pass (a collection's key has a tensor per feature): at
        # once where every value is None or a plain tensor that needs no gradient
        if all([value is None or (type(value) is torch.Tensor and not value.requires_grad) for value in key]):
            self.key = tuple([None if value is None else value.clone() for value in key])
        else:
            kept = []
            for value in key:
                if isinstance(value, torch.Tensor):
                    if value.requires_grad:
                        # a forward whose arguments need a gradient (per_sample_weights) plans its
                        # own: the output must be a function of its tensors, not of the prefetch's copies
                        replan = True
                        value = value.detach()
                    value = value.clone()
                kept.append(value)
            self.key = tuple(kept)
        # the tables it reads, and how often their rows changed on the servers other than by a
        # step (loads, half_async merges): a change after it was sent makes it stale
        self.tables = [(t, t._changes) for t in tables]
        # (what the plan depends on besides the arguments: whether each table records, its dtype)
        self.records, self.calls, self.finish, self.replan = records, calls, finish, replan
        self.overlap = overlap
        self.sent = False  # with a step's pushes
        self.pushes_at: list[int] = []  # each table's pushes sent, once that step was sent
        self.planned = False  # by prefetching() (a forward of other arguments leaves it for its own)
        # the prefetching() loop that planned it (one nested in another keeps apart), and the
        # index of its batch in that loop
        self.loop: object = None
        self.batch = 0
        self.got: list | None = None  # the answers' outcomes, once that step landed
        self.failed = False  # that step's push failed: dropped
        # half_async: the merge state reads sent ahead of its lookups, (server, table names) each,
        # their outcomes once landed, when the step was sent, and what its forward checks on
        # each server ({server: [(name, merges read)]}; None: nothing to check)
        self.merge_calls: list[tuple[str, list[str]]] = []
        self.merge_state: list = []
        self.sent_at = 0.0
        self.checks: dict[str, list[tuple[str, int]]] | None = None

    def merging(self) -> list:
        """Its half_async tables (whose servers merge on their own: by count, or on a timer)."""
        return [t for t, _ in self.tables if t.ps_mode == "half_async"]

    def merge_reads(self) -> list:
        """The reads of each server's merge state to send ahead of its lookups (half_async),
        remembered as :attr:`merge_calls`."""
        merging = self.merging()
        self.merge_calls = []
        if not merging:
            return []
        for server in dict.fromkeys(server for server, _, _ in self.calls):
            names = [t.name for t in merging if server in t._by_server]
            if names:
                self.merge_calls.append((server, names))
        return [(server, _handlers._merge_state, (names,)) for server, names in self.merge_calls]

    def merges_checked(self, began: float) -> bool:
        """(half_async, answered) Set :attr:`checks`: what the forward that began at ``began``
        (``time.monotonic()``) must ask the servers before using the answers, or None when it
        knows that no merge finished since they were read: every table has this trainer alone
        (``num_trainers=1``: no other pushes merge), none of their pushes came since, and no
        server's timer was due yet. False when a merge state read failed (not to be used)."""
        self.checks = None
        if not self.merge_calls or not self.sent:
            return True
        if not all(ok for ok, _ in self.merge_state):
            return False
        states = [(server, names, state) for (server, names), (_, state) in zip(self.merge_calls, self.merge_state)]
        alone = all(t.num_trainers == 1 for t in self.merging())
        pushed = any(t._pushes != n for (t, _), n in zip(self.tables, self.pushes_at))
        due = min(left for _, _, state in states for _, left in state)
        if alone and not pushed and began < self.sent_at + due:
            return True
        self.checks = {server: list(zip(names, (n for n, _ in state))) for server, names, state in states}
        return True

    def checked(self, got: list, send: Callable[[list], list]) -> list:
        """The answers ``got``, each replaced by a fresh lookup where its server merged since it
        was read (one message per server: :func:`_handlers._read_unless_merged`)."""
        calls = [(server, _handlers._read_unless_merged, UnlessMerged(self.checks[server], handler, read))
                 for server, handler, read in self.calls]
        return [old if new is None else new for old, new in zip(got, send(calls))]

    def changed(self) -> bool:
        """Whether a table's rows changed since it was sent (a load, a half_async merge): what
        it read is gone."""
        if self.sent:
            for table, changes in self.tables:
                if table._changes != changes:
                    return True
        return False

    def matches(self, key: tuple, records: Any) -> bool:
        """Whether a forward of ``key`` (``records``: as given at construction) may use it."""
        if records != self.records or len(key) != len(self.key) or self.changed():
            return False
        for given, kept in zip(key, self.key):  # equal by value (None to None), and none needs a gradient
            if given is None or kept is None:
                if given is not kept:
                    return False
            # (isinstance, told of a plain tensor without the call)
            elif not ((type(given) is torch.Tensor or isinstance(given, torch.Tensor))
                      and (type(kept) is torch.Tensor or isinstance(kept, torch.Tensor))) or given.requires_grad \
                    or given.dtype != kept.dtype or given.shape != kept.shape or not torch.equal(given, kept):
                return False
        return True

    def take_answers(self, reads: list, at: int) -> int:
        """(:class:`~remote_module.ps._steps.Flight`, its step landed) Take its reads' outcomes
        from ``reads``, the step's, at ``at`` (its merge state reads, then its lookups); where
        the next prefetch's begin."""
        n = len(self.merge_calls)
        self.merge_state = reads[at:at + n]
        self.got = reads[at + n:at + n + len(self.calls)]
        return at + n + len(self.calls)

    def answers(self) -> list | None:
        """The answers of its calls; None if one failed (the step's pushes went through: the
        forward looks up again, so a lookup's failure is raised by a lookup, as without prefetch)."""
        if not all(ok for ok, _ in self.got):
            return None
        return [value for _, value in self.got]


class PrefetchQueue:
    """The prefetches of a table or collection, in the order of the forwards they are for. A
    prefetch sent with a step, consumed after later pushes of its tables (by any object: the
    table, a collection, a PSModel), would miss them: it is used only if at most ``overlap``
    (0, or 1) came since."""

    def __init__(self) -> None:
        self.handles: list[Prefetch] = []
        #: what ``prefetching`` plans once the next step is sent (its later batches' prefetches,
        #: planned while the servers work): ``planned()`` each, with ``planned.keywords["loop"]``
        #: and ``["index"]`` naming its loop and batch (``functools.partial``)
        self.after_step: list[Any] = []

    def take_after_step(self) -> list:
        """(A step was sent) :attr:`after_step`'s plans, taken: the caller runs them."""
        after, self.after_step = self.after_step, []
        return after

    def add(self, handle: Prefetch, queued: bool) -> None:
        """A new prefetch: after the others when ``queued`` (``prefetching``'s later batches),
        else instead of them (``prefetch()``: one at a time)."""
        if queued:
            self.handles.append(handle)
        else:
            self.handles = [handle]

    def take(self, key: tuple, records: Any) -> Prefetch | None:
        """The prefetch for a forward of ``key``: the first that matches it, the ones before it
        dropped, except those another ``prefetching`` loop planned (an evaluation loop's inside
        the training loop's, or the other way round: each keeps its own). With none, a
        ``prefetch()`` is dropped (any other forward drops it), while ``prefetching``'s stay for
        the forwards they were planned for (an eval forward, say)."""
        for k, handle in enumerate(self.handles):
            if handle.matches(key, records):
                loop = handle.loop
                self.handles = [h for h in self.handles[:k] if loop is not None and h.loop is not None
                                and h.loop is not loop] + self.handles[k + 1:]
                return handle
        if self.handles and not self.handles[0].planned:
            self.handles.pop(0)
        # prefetching's that no forward can use any more (their step failed, or a push or a load
        # since made them stale) are dropped: else they hold up the sending of those after them
        # (to_send sends the first two) until a forward matches one of those
        self.handles = [h for h in self.handles if not h.sent or not (h.failed or h.changed() or not self.fresh(h))]
        return None

    def claim(self, key: tuple, records: Any, wait_pushes: Callable[[], None]) -> Prefetch | None:
        """The prefetch a forward of ``key`` uses (:meth:`take`, :meth:`fresh`), or None;
        ``wait_pushes()`` (for the pushes in flight) first, unless it was answered already (sent
        a step earlier, with overlap: used without waiting for them)."""
        began = time.monotonic()  # (half_async: the merges finished before now must be in what it uses)
        handle = self.take(key, records)
        use = handle is not None and not handle.failed and not handle.replan and self.fresh(handle)
        if not use or handle.got is None:
            wait_pushes()  # (answers the prefetch sent with those pushes)
        if use and not handle.failed and handle.got is not None:
            use = handle.merges_checked(began)
        return handle if use and not handle.failed else None

    @staticmethod
    def output(handle: Prefetch | None, send: Callable[[list], list], plan: Callable[[], tuple]) -> Any:
        """A forward's output: of ``handle``'s answers, or of its calls sent now (``send`` reads
        the steps of now: :func:`at_step`); else, or if one of its lookups failed (looked up
        again, so a lookup's failure is raised by a lookup), of ``plan()``'s calls."""
        if handle is not None:
            if handle.got is not None:
                got = handle.answers()
                if got is not None:
                    return handle.finish(got if handle.checks is None else handle.checked(got, send))
            elif not handle.sent:
                return handle.finish(send(handle.calls))
        lookup = plan()
        return lookup.finish(send(lookup.calls))

    def send(self, plans: Sequence[PushPlan], timeout: float | None, sync: bool,
             step_after: Callable[[str], int]) -> tuple[SentPushes, list[Prefetch]]:
        """Send a step's ``plans`` (:func:`send_push_plans`) with the prefetches it carries
        (:meth:`to_send`, reading the steps ``step_after`` gives a table's name once these pushes
        are applied): ``(the pushes sent, those prefetches)``."""
        joined = self.to_send(sync)
        sent = send_push_plans(plans, timeout, self.reads(joined, step_after))
        self.stepped(joined)
        return sent, joined

    @staticmethod
    def reads(joined: Sequence[Prefetch], step_after: Callable[[str], int]) -> list:
        """The reads a step sends for the prefetches ``joined`` (:meth:`send`): each one's merge
        state reads (half_async) and lookups, reading the steps ``step_after`` gives."""
        now = time.monotonic()  # (before the message leaves: a server's timer runs out no sooner)
        reads = []
        for handle in joined:
            handle.sent_at = now
            reads += handle.merge_reads()
            reads += at_step(handle.calls, step_after)
        return reads

    @staticmethod
    def fresh(handle: Prefetch) -> bool:
        """Whether ``handle`` misses at most the pushes it may (none; with overlap, one)."""
        if not handle.sent:
            return True
        allowed = 1 if handle.overlap else 0
        for (table, _), pushes in zip(handle.tables, handle.pushes_at):
            if table._pushes - pushes > allowed:
                return False
        return True

    def to_send(self, sync: bool) -> list[Prefetch]:
        """What a step sends with its pushes: the next forward's prefetch, if not sent yet; with
        overlap (not in sync mode, nor half_async: the step in between may merge, which a read
        sent before it cannot reflect), the one after it too."""
        out = []
        for k, handle in enumerate(self.handles[:2]):
            if not handle.sent and not handle.replan and (
                    k == 0 or (handle.overlap and not sync and not handle.merging())):
                out.append(handle)
        return out

    @staticmethod
    def stepped(sent: Sequence[Prefetch]) -> None:
        """A step was sent (its tables' pushes counted), and ``sent`` with it."""
        for handle in sent:
            handle.sent, handle.pushes_at = True, [t._pushes for t, _ in handle.tables]
            # (what it reads is the rows as of now: a load or a merge before now does not make it stale)
            handle.tables = [(t, t._changes) for t, _ in handle.tables]
