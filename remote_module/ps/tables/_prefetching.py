"""``prefetching``: a batch iterator whose next batch's lookups are planned while this one trains
and sent with its step's pushes (one message per server per step)."""

from __future__ import annotations

from collections import deque
from functools import partial
from typing import Any, Callable, Iterable, Iterator, Sequence

from torch import nn

from remote_module.ps.tables._collection import ShardedEmbeddingBagCollection
from remote_module.ps.tables._embedding import ShardedEmbedding

_PREFETCHERS = (ShardedEmbedding, ShardedEmbeddingBagCollection)


def _start(table: Any, features: Callable[[Any], Any], batch: Any, queued: bool, overlap: bool, *, loop: object,
           index: int) -> None:
    """Prefetch ``table``'s input of ``batch`` (``features(batch)``, the ``index``-th batch of
    the prefetching loop ``loop``): as the next forward's prefetch, or ``queued`` for a later
    one. A batch the prefetch refuses (or whose features fail) is left alone: its own forward
    raises, naming what is wrong."""
    try:
        handle = table._prefetch_input(features(batch), queued, overlap)
    except Exception:  # noqa: BLE001 - the forward of that batch reports it
        return
    handle.planned, handle.loop, handle.batch = True, loop, index


def _prune(table: Any, loop: object, index: int, behind: int) -> None:
    """Drop ``loop``'s plans of the batches yielded before its ``index``-th: those not sent yet
    (a batch trained without a step leaves its plan to the next step; a loop without steps, an
    evaluation, would keep every batch in them), and the prefetches more than ``behind`` batches
    back, which no forward used (forwards of other arguments would keep them all)."""
    queue = table._prefetches
    queue.after_step = [p for p in queue.after_step if p.keywords["loop"] is not loop or p.keywords["index"] > index]
    queue.handles = [h for h in queue.handles if h.loop is not loop or h.batch >= index - behind]


def prefetching(batches: Iterable, tables: Any, features: Callable[[Any], Any] | None = None, *,
                overlap: bool = False) -> Iterator:
    """Yield the batches of ``batches`` as they are, with every batch's lookups prefetched: a
    step sends its pushes and the next batch's lookups in one message per server, answered once
    the servers applied the pushes (results are those of the same loop without it). The batch
    after the next is planned while that answer is awaited (right after the step is sent), so
    the trainer's planning overlaps the servers' work; the iterator reads two batches ahead.

    half_async: a forward uses its prefetched lookup only if it holds every merge the servers
    finished before the forward began (else it reads again); with several trainers, or a step
    slower than ``half_async_merge_s``, that takes one small message per server at the forward
    (see :class:`~remote_module.ps.tables._prefetch.Prefetch`).

    ``overlap=True`` (async and half_async only; ``ValueError`` for a sync table) goes one
    batch further in async mode: a step sends the lookups of the batch after the next, so their
    round trip overlaps the next batch's compute and a forward never waits for the servers. Each
    of those lookups then misses exactly one push of this trainer, the last one before its
    forward (as an async read may miss other trainers' pushes); every earlier push is in it
    (from the loop's third batch on: the first two lookups go with its first step or before). In
    half_async mode the step in between may merge, which such a lookup could not hold: each is
    sent with the step right before its forward, as without overlap. The iterator then reads
    three batches ahead.

    Tables inside a :class:`PSModel`: pass them (or their collection) here and call the model's
    ``step()``, which sends their next lookups with its pushes, one message per server.

    ``tables``: a :class:`ShardedEmbedding` / :class:`ShardedEmbeddingBag`, a
    :class:`ShardedEmbeddingBagCollection`, or a sequence of them. ``features(batch)`` gives
    the input of each (for one: its input; for a sequence: a sequence in the same order): a
    table's ids tensor or ``(input, offsets, per_sample_weights)`` tuple, a collection's
    features mapping. Without ``features`` the batch itself is that input. An error of
    ``batches`` is raised after the batches read before it.

    Example::

        for ids, offsets, target in prefetching(loader, bag, features=lambda b: (b[0], b[1])):
            loss = loss_fn(model(bag(ids, offsets)), target)
            loss.backward()
            bag.step()
    """
    single, targets = _targets(tables)
    _check_arguments(targets, features, overlap)
    picks = [_feature_of(features, single, len(targets), k) for k in range(len(targets))]
    yield from _prefetched(iter(batches), targets, picks, overlap)


def _targets(tables: Any) -> tuple[bool, Sequence]:
    """(:func:`prefetching`) Whether ``tables`` is one table or collection, and them as a list,
    checked (``TypeError`` otherwise)."""
    single = isinstance(tables, _PREFETCHERS)
    wanted = ("prefetching takes a ShardedEmbedding, ShardedEmbeddingBag or ShardedEmbeddingBagCollection, "
              "or a sequence of them")
    if not single and isinstance(tables, nn.Module) and not isinstance(tables, nn.ModuleList):
        # (a model holding tables, a PSModel: its tables are what the lookups go to)
        raise TypeError(f"{wanted}, got a {type(tables).__name__}: pass the tables (or their collection) it holds, "
                        "and call its step() as usual; a PSModel's step() sends their prefetched lookups")
    try:
        targets: Sequence = [tables] if single else list(tables)
    except TypeError:
        raise TypeError(f"{wanted}, got {tables!r:.200}") from None
    if not targets or not all(isinstance(t, _PREFETCHERS) for t in targets):
        raise TypeError(f"{wanted}, got {tables!r:.200}")
    return single, targets


def _check_arguments(targets: Sequence, features: Any, overlap: Any) -> None:
    """(:func:`prefetching`) ``features`` and ``overlap`` checked, for ``targets``."""
    if features is not None and not callable(features):
        raise TypeError(f"features must be a function of a batch, got {features!r:.100}")
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be a bool, got {overlap!r}")
    if overlap and any(t.ps_mode == "sync" for t in targets):
        raise ValueError("prefetching(overlap=True) is for async and half_async tables: a sync table's lookups wait "
                         "for every trainer's step, so a lookup sent a step early cannot be answered before its "
                         "forward needs it; use overlap=False (the default) in sync mode")


def _feature_of(features: Callable[[Any], Any] | None, single: bool, n: int, k: int) -> Callable[[Any], Any]:
    """The input of the ``k``-th of ``n`` tables in a batch (``features(batch)``'s, or the batch)."""
    def pick(batch: Any) -> Any:
        value = batch if features is None else features(batch)
        if single:
            return value
        value = list(value)
        if len(value) != n:
            raise ValueError(f"prefetching: features(batch) gave {len(value)} inputs for {n} tables")
        return value[k]
    return pick


def _prefetched(it: Iterator, targets: Sequence, picks: list, overlap: bool) -> Iterator:
    """:func:`prefetching`'s loop over the batches of ``it``, checked already."""
    depth = 2 if overlap else 1  # steps a lookup is sent ahead of its forward
    # this loop's prefetches and planned calls: a loop nested in another on the same tables (an
    # evaluation loop inside the training loop) takes and drops only its own
    loop = object()
    ahead: deque = deque()  # read, not yet yielded
    failure: list[BaseException] = []

    def read(n: int) -> None:
        while len(ahead) < n and not failure:
            try:
                ahead.append(next(it))
            except StopIteration:
                failure.append(StopIteration())
            except BaseException as exc:  # raised once the batches read before it were yielded
                failure.append(exc)

    try:
        read(depth + 1)
        for table, pick in zip(targets, picks):
            queued = any(h.loop is not None for h in table._prefetches.handles)
            for k, batch in enumerate(ahead):
                _start(table, pick, batch, queued or k > 0, overlap, loop=loop, index=k)
        index = 0
        while ahead:
            current = ahead.popleft()
            read(depth + 1)
            for table, pick in zip(targets, picks):  # after the next step: depth + 1 batches on
                _prune(table, loop, index, depth + 1)
                if len(ahead) > depth:  # (a list: a batch trained without a step leaves its plan to the next)
                    table._prefetches.after_step.append(
                        partial(_start, table, pick, ahead[depth], True, overlap, loop=loop, index=index + depth + 1))
            index += 1
            yield current
        if failure and not isinstance(failure[0], StopIteration):
            raise failure[0]
    finally:  # (a loop left early: nothing it planned ahead stays behind; another loop's stays)
        _forget(targets, loop)


def _forget(targets: Sequence, loop: object) -> None:
    """Drop what the prefetching ``loop`` planned on ``targets`` and did not use."""
    for table in targets:
        queue = table._prefetches
        queue.after_step = [p for p in queue.after_step if p.keywords["loop"] is not loop]
        queue.handles = [h for h in queue.handles if h.loop is not loop]
