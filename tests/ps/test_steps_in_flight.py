"""The record of each object's last step in flight, by name (remote_module/ps/_steps.py): what
an object built again under that name waits for, in process, without RPC."""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch
from torch.futures import Future

from remote_module._core import CallTimeout
from remote_module.ps import _steps


def test_an_answered_step_leaves_nothing_of_its_answer_behind():
    """The answer of a step nothing lands (its object gone right after step()) is not kept
    alive by the record: a sync PSModel's answer is its values."""
    fut = Future()
    _steps._sending(["leak-check"], fut)
    assert "leak-check" in _steps._last_sent
    answer = torch.zeros(1000)
    seen = weakref.ref(answer)
    fut.set_result([answer])
    del answer, fut
    gc.collect()
    assert "leak-check" not in _steps._last_sent
    assert seen() is None
    _steps.wait_for_earlier("leak-check", 0.1, "test")  # nothing to wait for


def test_a_rebuild_waits_for_its_own_timeout_at_most_and_changes_nothing():
    fut = Future()
    _steps._sending(["slow"], fut)
    start = time.monotonic()
    with pytest.raises(CallTimeout, match="in flight"):
        _steps.wait_for_earlier("slow", 0.2, "PSModel 'slow'")
    assert time.monotonic() - start < 2
    assert "slow" in _steps._last_sent  # (refused: the next build waits for it again)
    fut.set_result([])
    _steps.wait_for_earlier("slow", 0.2, "PSModel 'slow'")
    assert "slow" not in _steps._last_sent
