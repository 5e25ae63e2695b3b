"""Sync waits that reached their deadline, seen at any speed (tests/ps worlds).

A sync read that waits for a step that cannot be applied (a pull, a lookup, a push answered
once its step is applied; a trainer dead or never attached) fails on its server at its
deadline, a little before the trainer's own timeout (the library keeps ``answer_margin`` of it
back for the answer), naming the trainers that have not pushed. On a loaded machine that answer
may come after the trainer's deadline: the trainer's call then fails by its own timeout,
naming the server. Either is the timeout's error, and which one the trainer sees depends on
speed. So :func:`assert_stalled` takes either, checks the servers' answer names the right
trainers where it is the one seen, and checks on the servers themselves that the wait failed
at its deadline naming them: every server of a tests/ps/_world.py world records those failures
(:func:`record`, started by ``_dense_remote.ready``), and :func:`stalls` reads them.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any

from tests._deadlines import HANG_S

_lock = threading.Lock()
#: (on a server) each sync wait failed at its deadline: (owner label, step, missing, never attached)
_stalls: list[tuple[str, int, list[str], int]] = []


def record() -> None:
    """(On a server) from now on, record each sync wait failed at its deadline (what its error
    names), as the library's ``fail_stalled`` reports it."""
    from remote_module.ps import _modes

    if getattr(_modes.fail_stalled, "recording", False):
        return
    original = _modes.fail_stalled

    def fail_stalled(future: Any, what: str, noun: str, step: int, missing: list[str], never: int,
                     num_trainers: int) -> None:
        with _lock:
            _stalls.append((what, step, list(missing), never))
        original(future, what, noun, step, missing, never, num_trainers)

    fail_stalled.recording = True  # type: ignore[attr-defined]
    _modes.fail_stalled = fail_stalled


def stalls(name: str) -> list[tuple[int, list[str], int]]:
    """(On a server) the recorded stalls of the job or table ``name``: ``(step, missing, never)``."""
    with _lock:
        return [(step, missing, never) for what, step, missing, never in _stalls if what.endswith(repr(name))]


def assert_stalled(world: Any, outcome: dict, name: str, what: str, timeout: float,
                   missing: tuple[str, ...] = ("trainer1",), never: int = 0, step: int = 0) -> None:
    """``outcome`` (``ok``, ``type``, ``message``, ``seconds``) of a call on job or table
    ``name`` that waited for sync step ``step``, which the test keeps from being applied (for
    good: a trainer dead, late until the outcome is in, or never attached), its timeout
    ``timeout``: it failed by a timeout, either the servers' wait (its error naming ``missing``
    and no other trainer, or ``never`` trainers never attached) or the call's own (``no answer
    within timeout``: the servers' answer came later, on a loaded machine); and a server's wait
    for the job failed at its deadline naming exactly those, as every such wait of the job
    did. The only bound on the call's time is a hang guard."""
    assert not outcome["ok"] and outcome["type"] == "CallTimeout", f"{what}: not a timeout's error: {outcome}"
    message = outcome["message"]
    if "was not applied in time" in message:  # the servers' answer
        assert re.search(rf"\bstep {step}( \([^)]*\))? was not applied in time", message), \
            f"{what}: not step {step}'s wait: {message}"
        named = message.split("waiting for gradients from", 1)[1].split("(sync mode", 1)[0]
        trainers = [n for n in world.names if n.startswith("trainer")]
        for t in trainers:
            assert (repr(t) in named) == (t in missing), f"{what}: the error names {named!r}, not {missing}: {message}"
        assert ("never attached" in named) == (never > 0), f"{what}: never attached: {never}? {message}"
    else:  # the call's own timeout: the servers' answer had not come yet
        assert f"no answer within {timeout:g} s" in message, f"{what}: not the call's own timeout either: {outcome}"
    assert outcome["seconds"] < timeout + HANG_S, f"{what}: hang guard: no end within timeout + {HANG_S} s: {outcome}"
    servers = [n for n in world.names if n.startswith("ps") and world.procs[n].poll() is None]  # (alive)
    deadline = time.monotonic() + HANG_S
    while not (got := [s for per in world.run({server: (stalls, name) for server in servers}).values() for s in per]):
        assert time.monotonic() < deadline, f"{what}: hang guard: no server's wait for {name!r} failed"
        time.sleep(0.05)
    assert all((st, m, n) == (step, list(missing), never) for st, m, n in got), \
        f"{what}: the servers' waits (step, missing, never attached) were {got}, not {(step, list(missing), never)}"
