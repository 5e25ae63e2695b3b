"""rpc_backend.run_local: results by rank, bounded failure."""

import time

import pytest

from rpc_backend import LocalWorldError, run_local
from tests import _launcher_fns


def test_returns_values_ordered_by_rank():
    assert run_local(_launcher_fns.rank_and_sum, 3, args=(10,), timeout=60) == [
        ("worker0", 10, "0", "3"),
        ("worker1", 11, "1", "3"),
        ("worker2", 12, "2", "3"),
    ]


def test_a_failing_rank_stops_the_world_quickly():
    start = time.monotonic()
    with pytest.raises(LocalWorldError) as info:
        run_local(_launcher_fns.second_rank_fails, 3, timeout=60, rpc_timeout=120)
    assert info.value.rank == 1
    assert "rank 1 fails on purpose" in str(info.value)
    # the other ranks wait in a barrier forever; the launcher must not
    assert time.monotonic() - start < 30


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        run_local(_launcher_fns.rank_and_sum, 0)
    with pytest.raises(ValueError, match="distinct"):
        run_local(_launcher_fns.rank_and_sum, 2, names=["a", "a"])


def test_a_rank_that_cannot_start_raises_its_own_error():
    # spawn pickles a rank's arguments when it starts it: the caller gets that error, not a
    # failure of the cleanup that follows ("can only join a started process")
    import threading

    with pytest.raises(TypeError, match="pickle"):
        run_local(_launcher_fns.rank_and_sum, 2, args=(threading.Lock(),), timeout=60)
