"""``prefetching``: a batch iterator whose next batch's lookups are planned while this one trains
and sent with its step's pushes (one message per server per step)."""

from __future__ import annotations

from collections import deque
from functools import partial
from typing import Any, Callable, Iterable, Iterator, Sequence

from remote_module.ps._collection import ShardedEmbeddingBagCollection
from remote_module.ps._embedding import ShardedEmbedding

_PREFETCHERS = (ShardedEmbedding, ShardedEmbeddingBagCollection)


def _start(table: Any, features: Callable[[Any], Any], batch: Any, queued: bool) -> None:
    """Prefetch ``table``'s input of ``batch`` (``features(batch)``): as the next forward's
    prefetch, or ``queued`` for the one after. A batch the prefetch refuses (or whose features
    fail) is left alone: its own forward raises, naming what is wrong."""
    try:
        table._prefetch_input(features(batch), queued)
    except Exception:  # noqa: BLE001 - the forward of that batch reports it
        pass


def prefetching(batches: Iterable, tables: Any, features: Callable[[Any], Any] | None = None) -> Iterator:
    """Yield the batches of ``batches`` as they are, with every batch's lookups prefetched: a
    step sends its pushes and the next batch's lookups in one message per server, answered once
    the servers applied the pushes (results are those of the same loop without it). The batch
    after the next is planned while that answer is awaited (right after the step is sent), so
    the trainer's planning overlaps the servers' work; the iterator reads two batches ahead.

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
    single = isinstance(tables, _PREFETCHERS)
    targets: Sequence = [tables] if single else list(tables)
    if not targets or not all(isinstance(t, _PREFETCHERS) for t in targets):
        raise TypeError("prefetching takes a ShardedEmbedding, ShardedEmbeddingBag or ShardedEmbeddingBagCollection, "
                        f"or a sequence of them, got {tables!r:.200}")
    if features is not None and not callable(features):
        raise TypeError(f"features must be a function of a batch, got {features!r:.100}")

    def feature_of(k: int) -> Callable[[Any], Any]:
        def pick(batch: Any) -> Any:
            value = batch if features is None else features(batch)
            if single:
                return value
            value = list(value)
            if len(value) != len(targets):
                raise ValueError(f"prefetching: features(batch) gave {len(value)} inputs for {len(targets)} tables")
            return value[k]
        return pick

    picks = [feature_of(k) for k in range(len(targets))]
    it = iter(batches)
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
        read(2)
        for table, pick in zip(targets, picks):
            if ahead:
                _start(table, pick, ahead[0], False)
            if len(ahead) > 1:
                _start(table, pick, ahead[1], True)
        while ahead:
            current = ahead.popleft()
            read(2)
            for table, pick in zip(targets, picks):  # after this batch's step: the batch after the next
                if len(ahead) > 1:
                    table._after_step = partial(_start, table, pick, ahead[1], True)
                else:
                    table.__dict__.pop("_after_step", None)
            yield current
        if failure and not isinstance(failure[0], StopIteration):
            raise failure[0]
    finally:  # (a loop left early: nothing planned ahead stays behind)
        for table in targets:
            table.__dict__.pop("_after_step", None)
            table.__dict__.pop("_queued", None)
