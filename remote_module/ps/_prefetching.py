"""``prefetching``: a batch iterator whose next batch's lookups are planned while this one trains
and sent with its step's pushes (one message per server per step)."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Iterable, Iterator, Sequence

from remote_module.ps._collection import ShardedEmbeddingBagCollection
from remote_module.ps._embedding import ShardedEmbedding

_PREFETCHERS = (ShardedEmbedding, ShardedEmbeddingBagCollection)


def _start(table: Any, value: Any) -> None:
    """Prefetch ``value`` (a table's input, or a collection's features) on ``table``. A batch
    the prefetch refuses is left alone: its own forward raises, naming what is wrong."""
    try:
        if isinstance(table, ShardedEmbeddingBagCollection) or not isinstance(value, (tuple, list)):
            table.prefetch(value)
        else:
            table.prefetch(*value)
    except Exception:  # noqa: BLE001 - the forward of that batch reports it
        pass


def prefetching(batches: Iterable, tables: Any, features: Callable[[Any], Any] | None = None) -> Iterator:
    """Yield the batches of ``batches`` as they are, and prefetch every batch's lookups one
    batch ahead: the first batch's at once; batch ``k + 1``'s when a table's forward of batch
    ``k`` is done, so they are sent with batch ``k``'s ``step()`` (one message per server) and
    answered once the servers applied it. Results are those of the same loop without it.

    ``tables``: a :class:`ShardedEmbedding` / :class:`ShardedEmbeddingBag`, a
    :class:`ShardedEmbeddingBagCollection`, or a sequence of them. ``features(batch)`` gives
    the input of each (for one: its input; for a sequence: a sequence in the same order): a
    table's ids tensor or ``(input, offsets, per_sample_weights)`` tuple, a collection's
    features mapping. Without ``features`` the batch itself is that input.

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

    def inputs(batch: Any) -> list:
        value = batch if features is None else features(batch)
        if single:
            return [value]
        value = list(value)
        if len(value) != len(targets):
            raise ValueError(f"prefetching: features(batch) gave {len(value)} inputs for {len(targets)} tables")
        return value

    it = iter(batches)
    try:
        current = next(it)
    except StopIteration:
        return
    for table, value in zip(targets, inputs(current)):
        _start(table, value)
    try:
        while True:
            try:
                upcoming, more = next(it), True
            except StopIteration:
                upcoming, more = None, False
            except BaseException:  # the loader failed: this batch still trains, then its error
                for table in targets:
                    table.__dict__.pop("_next_prefetch", None)
                yield current
                raise
            for table, value in zip(targets, inputs(upcoming) if more else [None] * len(targets)):
                if more:  # run by the table's next forward (of this batch), once it consumed its prefetch
                    table._next_prefetch = partial(_start, table, value)
                else:
                    table.__dict__.pop("_next_prefetch", None)
            yield current
            if not more:
                return
            current = upcoming
    finally:  # (a loop left early: no later forward prefetches a batch that never comes)
        for table in targets:
            table.__dict__.pop("_next_prefetch", None)
