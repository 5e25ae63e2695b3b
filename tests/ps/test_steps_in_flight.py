"""The record of each object's last step in flight, by name (remote_module/ps/_steps.py): what
an object built again under that name waits for, in process, without RPC."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch
from torch.futures import Future

from remote_module._core import CallTimeout
from remote_module.ps import _steps


def _flight(name: str) -> tuple[_steps.Flight, Future]:
    """A step's flight for an object named ``name``, its message not answered yet."""
    fut = Future()
    return _steps.Flight(_steps.SentPushes([], fut, lambda got: ([], [])), names=[name]), fut


def test_a_landed_step_leaves_no_record():
    flight, fut = _flight("landed")
    assert _steps._last_sent["landed"] is fut
    fut.set_result([])
    flight.land()
    assert "landed" not in _steps._last_sent


def test_a_step_dropped_unlanded_leaves_nothing_of_its_answer_behind():
    """The answer of a step nothing lands (its object gone right after step()) is not kept
    alive by the record: a sync PSModel's answer is its values. A rebuild meanwhile still
    waits for the message."""
    flight, fut = _flight("leak-check")
    del flight
    gc.collect()
    assert isinstance(_steps._last_sent["leak-check"], threading.Event)  # (the future is not held)
    with pytest.raises(CallTimeout):
        _steps.wait_for_earlier("leak-check", 0.1, "test")
    answer = torch.zeros(1000)
    seen = weakref.ref(answer)
    fut.set_result([answer])
    del answer, fut
    gc.collect()
    assert "leak-check" not in _steps._last_sent
    assert seen() is None
    _steps.wait_for_earlier("leak-check", 0.1, "test")  # nothing to wait for


def test_a_rebuild_waits_for_its_own_timeout_at_most_and_changes_nothing():
    flight, fut = _flight("slow")
    start = time.monotonic()
    with pytest.raises(CallTimeout, match="in flight"):
        _steps.wait_for_earlier("slow", 0.2, "PSModel 'slow'")
    assert time.monotonic() - start < 2
    assert "slow" in _steps._last_sent  # (refused: the next build waits for it again)
    fut.set_result([])
    _steps.wait_for_earlier("slow", 0.2, "PSModel 'slow'")  # answered, its flight not landed: no wait
    assert "slow" not in _steps._last_sent
    flight.land()
