"""A table's lookups as host calls: sent (:func:`lookup_calls`), and read at the step of now
(:func:`at_step`: a lookup planned ahead is sent after a step, or at its forward), with the
sync steps of a table the servers refused that this trainer was told of (:func:`told_refusals`)."""

from __future__ import annotations

from typing import Any, Callable, Iterable, NamedTuple

from remote_module._core import call_all, call_one
from remote_module.ps._modes import StepRefusal, refusals_told
from remote_module.ps.tables.server import _handlers
from remote_module.ps.tables.server._requests import BagsRead, PooledRead, RowsRead


class LookupPlan(NamedTuple):
    """A lookup in two halves: the host calls that fetch it (each carrying a ``RowsRead``,
    ``BagsRead`` or ``PooledRead``), and ``finish(their answers)``, which makes its result (so
    that a collection sends several tables' calls to a server in one message, and a prefetch
    sends them ahead of the forward that finishes them)."""

    calls: list
    finish: Callable[[list], Any]


def lookup_calls(calls: list, timeout: float | None) -> list:
    """The answers of a lookup's host calls (:func:`call_all`; one call waited for in this
    thread, :func:`call_one`: a lookup's answer holds tensors only)."""
    if len(calls) == 1:
        return [call_one(calls[0], timeout)]
    return call_all(calls, timeout=timeout)


#: the lookup handlers that wait for the step (sync): a lookup through them carries how many
#: of the table's refused steps this trainer was told of
_TOLD_REFUSALS = (_handlers._rows_for, _handlers._bags_when_applied, _handlers._pool_tables)


#: sync tables: how many of each table's refused steps (by name) this process was told of (the
#: count its servers gave when it attached, then the count each refusal raised here named)
_refusals_seen: dict[str, int] = {}


def told_refusals(error: BaseException, names: Iterable[str]) -> None:
    """``error``, raised by a lookup of tables ``names``, is the refusal of a sync step of some
    of them (:class:`StepRefusal`): this trainer was told of it, and its next lookups of those
    tables go on (each of their servers fails a lookup of a trainer not told of its last one)."""
    if not isinstance(error, StepRefusal):
        return
    for name in names:
        told = refusals_told(error, f"sharded table {name!r}")
        if told > _refusals_seen.get(name, 0):
            _refusals_seen[name] = told


def at_step(calls: list, step_of: Callable[[str], int]) -> list:
    """``calls`` (a lookup's: :class:`RowsRead`, :class:`BagsRead` or :class:`PooledRead`
    each) reading the steps ``step_of(table name)`` gives now (a lookup planned ahead is sent
    after a step, or at its forward), and, in sync mode, how many of the table's refused steps
    this trainer was told of now (:func:`told_refusals`). Other calls (a prefetch's check of
    its reads, ``UnlessMerged``) go as they are."""
    out = []
    for server, handler, read in calls:
        told = handler in _TOLD_REFUSALS
        if isinstance(read, PooledRead):
            read = read._replace(steps=[step_of(n) for n in read.names])
            if told:
                read = read._replace(seen=[_refusals_seen.get(n, 0) for n in read.names])
        elif isinstance(read, (RowsRead, BagsRead)):
            read = read._replace(step=step_of(read.name))
            if told:
                read = read._replace(seen=_refusals_seen.get(read.name, 0))
        out.append((server, handler, read))
    return out


def refused_before_attach(name: str, refused: Iterable[int]) -> None:
    """(sync) A table ``name`` attached to its servers, which had refused ``refused`` of its
    steps each: those came before this trainer's table, so they are not its to be told of."""
    _refusals_seen[name] = max([_refusals_seen.get(name, 0), *refused])
