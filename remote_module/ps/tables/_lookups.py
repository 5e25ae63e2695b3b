"""A table's lookups as host calls: sent (:func:`lookup_calls`), and read at the step of now
(:func:`at_step`: a lookup planned ahead is sent after a step, or at its forward), with the
sync steps of a table the servers refused that this trainer was told of (:func:`told_refusals`)."""

from __future__ import annotations

from typing import Callable, Iterable

from remote_module._core import call_all, call_one
from remote_module.ps._modes import StepRefusal, refusals_told
from remote_module.ps.tables.server import _handlers


def lookup_calls(calls: list, timeout: float | None) -> list:
    """The answers of a lookup's host calls (:func:`call_all`; one call waited for in this
    thread, :func:`call_one`: a lookup's answer holds tensors only)."""
    if len(calls) == 1:
        return [call_one(calls[0], timeout)]
    return call_all(calls, timeout=timeout)


#: where a lookup handler takes the table's step (sync: the lookup waits for step - 1)
_STEP_AT = {_handlers._rows_for: 2, _handlers._rows_now: 2, _handlers._bags_when_applied: 5,
            _handlers._bags_now: 5}


#: where a sync lookup handler takes how many of the table's refused steps this trainer was told of
_SEEN_AT = {_handlers._rows_for: 5, _handlers._bags_when_applied: 7, _handlers._pool_tables: 7}


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
    """``calls`` (a lookup's) reading the steps ``step_of(table name)`` gives now (a lookup
    planned ahead is sent after a step, or at its forward), and, in sync mode, how many of the
    table's refused steps this trainer was told of now (:func:`told_refusals`)."""
    out = []
    for server, handler, args in calls:
        if handler is _handlers._pool_tables:
            args = (args[0], [step_of(n) for n in args[0]], *args[2:])
        elif handler in _STEP_AT:
            at = _STEP_AT[handler]
            args = (*args[:at], step_of(args[0]), *args[at + 1:])
        if handler in _SEEN_AT:
            names = args[0] if handler is _handlers._pool_tables else [args[0]]
            seen = [_refusals_seen.get(n, 0) for n in names]
            at = _SEEN_AT[handler]
            args = (*args[:at], seen if handler is _handlers._pool_tables else seen[0])
        out.append((server, handler, args))
    return out


def refused_before_attach(name: str, refused: Iterable[int]) -> None:
    """(sync) A table ``name`` attached to its servers, which had refused ``refused`` of its
    steps each: those came before this trainer's table, so they are not its to be told of."""
    _refusals_seen[name] = max([_refusals_seen.get(name, 0), *refused])
