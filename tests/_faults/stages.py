"""Pipeline stages that fail, stall or die on demand, and per-host counters of what they ran
(run by tests/pipeline/test_faults.py and tests/_faults/pipeline_world.py). Module level: RPC
runs them by reference.

A :class:`Step` stage adds ``add`` to its input. What it does besides is set per ``tag`` on its
host with :func:`configure` (so one pipeline can fail, stall and then work again):

    fail_on   a value: raise ``error`` when the input contains it
    error     "ValueError", "StageError" (defined here, importable on the caller) or "SystemExit"
    pause     seconds to sleep before answering
    gate      a key: block until ``tests._faults.gates.release(key)`` (at most HANG_S, a hang guard)
    gate_on   a value: with ``gate``, block only when the input contains it
    die_on    a value: SIGKILL this process when the input contains it

Each forward is counted per tag on its host (:func:`counts`): ``entered``/``left`` say how many
started and finished (a micro-batch cancelled before its turn is in neither), ``seen`` lists the
first input value of each, in order.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import torch
from torch import nn

_lock = threading.Lock()
_config: dict[str, dict[str, Any]] = {}
_counts: dict[str, dict[str, Any]] = {}
_events: list[tuple[str, str, float]] = []  # (tag, "enter"/"exit", first input value)


class StageError(Exception):
    """A user exception class a stage raises; importable on the caller."""


def _make_error(kind: str, message: str) -> BaseException:
    if kind == "ValueError":
        return ValueError(message)
    if kind == "StageError":
        return StageError(message)
    if kind == "SystemExit":
        return SystemExit(message)
    raise NotImplementedError(f"unknown error kind {kind!r}")


def configure(tag: str, **settings: Any) -> None:
    """On a host: replace what stages tagged ``tag`` do besides adding (see the module doc)."""
    with _lock:
        _config[tag] = dict(settings)


def counts(tag: str) -> dict[str, Any]:
    """On a host: ``{"entered": n, "left": n, "seen": [first input value, ...]}`` for ``tag``."""
    with _lock:
        found = _counts.get(tag, {"entered": 0, "left": 0, "seen": []})
        return {"entered": found["entered"], "left": found["left"], "seen": list(found["seen"])}


def events(tag: str) -> list[tuple[str, float]]:
    """On a host: ``(kind, value)`` for every enter/exit of forwards tagged ``tag``, in order."""
    with _lock:
        return [(kind, value) for t, kind, value in _events if t == tag]


def _bump(tag: str, field: str, value: float) -> None:
    with _lock:
        found = _counts.setdefault(tag, {"entered": 0, "left": 0, "seen": []})
        found[field] += 1
        if field == "entered":
            found["seen"].append(value)
        _events.append((tag, "enter" if field == "entered" else "exit", value))


class Step(nn.Module):
    """``x + add`` (the first of several positional inputs), counted and configured per ``tag``."""

    def __init__(self, tag: str, add: float = 1.0) -> None:
        super().__init__()
        self.tag = tag
        self.add = add

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value = float(x.reshape(-1)[0])
        _bump(self.tag, "entered", value)
        try:
            with _lock:
                settings = dict(_config.get(self.tag, {}))
            contains = lambda v: v is not None and bool((x == v).any())  # noqa: E731
            if contains(settings.get("die_on")):
                os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(60)  # never returns: the signal is immediate
            if settings.get("pause"):
                time.sleep(settings["pause"])
            if settings.get("gate") and ("gate_on" not in settings or contains(settings["gate_on"])):
                from tests._faults.gates import hold

                hold(settings["gate"])
            if contains(settings.get("fail_on")):
                raise _make_error(settings.get("error", "ValueError"), f"stage {self.tag} refuses {value:g}")
            return x + self.add
        finally:
            _bump(self.tag, "left", value)
