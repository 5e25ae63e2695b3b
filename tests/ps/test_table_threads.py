"""Threads of one trainer sharing a sharded table: none deadlocks in torch's autograd (its own
process: a deadlock holds the GIL for good and would take a shared world down)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests._deadlines import HANG_S, SETUP_S

pytestmark = pytest.mark.slow


def test_threads_looking_up_one_table_with_grad_on_never_deadlock():
    """Four threads, each looking up the same ShardedEmbedding and ShardedEmbeddingBag with grad
    on and backpropagating, as fast as they can for 3 s. Before the fix about one run in two
    deadlocked within 0.2 s: one thread found the table's grad_marker's AccumulateGrad in
    an op run without the GIL (holding the leaf's autograd lock, waiting for the GIL) while
    another applied the recording Function (holding the GIL, waiting for that lock)."""
    hang_s = SETUP_S + HANG_S  # a hang guard (the world's start-up, then the threads), no time limit
    try:
        proc = subprocess.run([sys.executable, "-m", "tests.ps._threads_script"], capture_output=True, text=True,
                              timeout=hang_s)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"threads looking up one table hung (a deadlock): no answer within {hang_s} s") from exc
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["ended"] == [True] * 4, got
    assert all(n > 0 for n in got["lookups"]), got
