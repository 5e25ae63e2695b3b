"""The memory a server copies save snapshots into (``_shard_io.SnapshotMemory``): kept after a
write for the next snapshot only when asked, reused only when it fits, freed when not taken again
in time."""

from __future__ import annotations

import math
import time

import pytest
import torch

from remote_module.ps._shard_io import SnapshotMemory
from tests._deadlines import HANG_S


def test_without_keeping_each_copy_is_fresh_and_nothing_is_held():
    memory, source = SnapshotMemory(), torch.randn(100, 4)
    a = memory.copy(("t", 0), source, 0)
    memory.keep(("t", 0), a, 0)
    b = memory.copy(("t", 0), source, 0)
    assert torch.equal(a, source) and torch.equal(b, source)
    assert a.data_ptr() != source.data_ptr() and b.data_ptr() != a.data_ptr()
    assert memory.held_bytes() == 0


def test_kept_memory_is_taken_by_the_next_copy_of_the_same_shape_and_only_once():
    memory, source = SnapshotMemory(), torch.randn(100, 4)
    a = memory.copy(("t", 0), source, 60)
    memory.keep(("t", 0), a, 60)
    assert memory.held_bytes() == a.numel() * a.element_size()
    source.add_(1)
    b = memory.copy(("t", 0), source, 60)
    assert b.data_ptr() == a.data_ptr() and torch.equal(b, source)
    assert memory.held_bytes() == 0  # (taken: a second copy meanwhile gets fresh memory)
    c = memory.copy(("t", 0), source, 60)
    assert c.data_ptr() != b.data_ptr() and torch.equal(c, source)


def test_kept_memory_of_another_shape_or_key_is_not_used():
    memory = SnapshotMemory()
    a = memory.copy(("t", 0), torch.randn(100, 4), 60)
    memory.keep(("t", 0), a, 60)
    bigger = torch.randn(101, 4)
    b = memory.copy(("t", 0), bigger, 60)
    assert b.data_ptr() != a.data_ptr() and torch.equal(b, bigger)
    memory.keep(("t", 0), b, 60)
    other = memory.copy(("t", 1), torch.randn(101, 4), 60)
    assert other.data_ptr() != b.data_ptr()
    doubles = torch.randn(101, 4, dtype=torch.float64)
    d = memory.copy(("t", 0), doubles, 60)
    assert d.dtype == torch.float64 and torch.equal(d, doubles) and d.data_ptr() != b.data_ptr()


def test_kept_memory_not_taken_again_in_time_is_freed():
    memory = SnapshotMemory()
    a = memory.copy(("t", 0), torch.randn(100, 4), 0.05)
    memory.keep(("t", 0), a, 0.05)
    deadline = time.monotonic() + HANG_S
    while memory.held_bytes() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert memory.held_bytes() == 0
    # a later keep's timer is not cut short by an earlier one's
    first = memory.keep(("t", 0), a, 0.05)
    b = memory.copy(("t", 0), torch.randn(100, 4), 60)
    memory.keep(("t", 0), b, 60)
    first.join(HANG_S)
    assert not first.is_alive()
    assert memory.held_bytes() == b.numel() * b.element_size()
    first.function(*first.args)  # (even one that fires after the memory was kept again)
    assert memory.held_bytes() == b.numel() * b.element_size()


def test_a_key_kept_again_and_again_runs_one_timer_not_one_per_save():
    memory, source = SnapshotMemory(), torch.randn(100, 4)
    timers = []
    for _ in range(50):  # (a job saving every second, each save's memory kept for minutes)
        timers.append(memory.keep(("t", 0), memory.copy(("t", 0), source, 600), 600))
    for timer in timers[:-1]:
        timer.join(HANG_S)  # (cancelled: each returns at once)
    assert [t.is_alive() for t in timers] == [False] * 49 + [True]
    timers[-1].cancel()


def test_memory_kept_again_or_taken_stops_the_timer_that_would_have_freed_it():
    # a Checkpointer keeps each block's memory after every save for at least two minutes: a
    # timer left running per keep would leave one thread per block per save alive that long
    memory, source = SnapshotMemory(), torch.randn(100, 4)
    timers = []
    for _ in range(5):
        kept = memory.copy(("t", 0), source, 60)
        timers.append(memory.keep(("t", 0), kept, 60))
    assert all(t.finished.is_set() for t in timers[:-1]), "a timer of memory taken again still runs"
    assert not timers[-1].finished.is_set()
    memory.keep(("t", 0), torch.randn(100, 4), 60)  # (kept over, not taken: the last timer stops too)
    assert timers[-1].finished.is_set()
    for timer in timers:
        timer.join(HANG_S)
        assert not timer.is_alive()
    assert memory.held_bytes() == source.numel() * source.element_size()
    memory.forget(lambda key: True)
    assert memory.held_bytes() == 0


def test_memory_that_cannot_get_its_timer_is_not_kept_and_the_keep_does_not_raise(monkeypatch):
    # (keep runs at the end of a server's background write: a thread that cannot start, a
    # process at its thread limit, must not turn a written save into a failed one)
    import threading

    def refused(self):
        raise RuntimeError("can't start new thread")

    memory = SnapshotMemory()
    a = memory.copy(("t", 0), torch.randn(100, 4), 60)
    monkeypatch.setattr(threading.Timer, "start", refused)
    assert memory.keep(("t", 0), a, 60) is None
    assert memory.held_bytes() == 0  # (nothing would free it)


@pytest.mark.parametrize("keep_s", [math.inf, math.nan, -1.0])
def test_a_save_asking_to_keep_its_memory_forever_or_for_no_number_of_seconds_is_refused(tmp_path, keep_s):
    # (a server's timer of inf seconds dies at once, OverflowError: the memory would be kept for good)
    from remote_module.ps.checkpoint._shards import begin_save_shards

    with pytest.raises(ValueError, match="keep_snapshot_s must be a finite number of seconds"):
        begin_save_shards(tmp_path / "ckpt", {}, keep_snapshot_s=keep_s)
    assert not (tmp_path / "ckpt").exists()


def test_a_copy_that_keeps_nothing_still_takes_the_memory_kept_so_no_third_copy_is_held():
    # a save_shards (keeps nothing) while a Checkpointer's memory is kept: the table, the kept
    # memory and a fresh copy would all be held while it writes
    memory, source = SnapshotMemory(), torch.randn(100, 4)
    a = memory.copy(("t", 0), source, 60)
    timer = memory.keep(("t", 0), a, 60)
    source.add_(1)
    b = memory.copy(("t", 0), source, 0)
    assert b.data_ptr() == a.data_ptr() and torch.equal(b, source)
    assert memory.held_bytes() == 0 and timer.finished.is_set()
    assert memory.keep(("t", 0), b, 0) is None and memory.held_bytes() == 0  # (freed once written)


def test_a_copy_into_memory_kept_with_a_stamp_copies_only_the_rows_changed_since():
    memory = SnapshotMemory()
    source = torch.randn(100, 4)
    first = memory.copy(("t", 0), source, 60)
    memory.keep(("t", 0), first, 60, stamp="v1")
    changed = torch.tensor([3, 50, 97])
    source[changed] += 1.0
    asked = []

    def since(stamp):
        asked.append(stamp)
        return changed

    again = memory.copy(("t", 0), source, 60, since)
    assert asked == ["v1"] and again.data_ptr() == first.data_ptr() and torch.equal(again, source)
    # what the callback says is what is copied: a row it leaves out keeps the kept value
    memory.keep(("t", 0), again, 60, stamp="v2")
    kept_row = source[10].clone()
    source[10] += 1.0
    stale = memory.copy(("t", 0), source, 60, lambda stamp: torch.empty(0, dtype=torch.long))
    assert torch.equal(stale[10], kept_row) and not torch.equal(stale, source)
    # no stamp, an unknown change (None) or most rows changed: the whole copied
    for stamp, answer in ((None, changed), ("v3", None), ("v3", torch.arange(60))):
        memory.keep(("t", 0), stale, 60, stamp=stamp)
        source[0] += 1.0
        whole = memory.copy(("t", 0), source, 60, lambda s, a=answer: a)
        assert torch.equal(whole, source), stamp
        stale = whole
    memory.forget(lambda key: True)
