"""The admission sketch (remote_module/ps/tables/lifetime/_admission.py): packed saturating counters whose
estimates never fall below an id's true count, and its checkpoint parts."""

from __future__ import annotations

import pytest
import torch

from remote_module.ps.tables.lifetime._admission import CountingSketch, counter_bits, false_admission_rate


@pytest.mark.parametrize("threshold, bits", [(2, 2), (3, 2), (4, 4), (15, 4), (16, 8), (255, 8)])
def test_counters_are_as_narrow_as_the_threshold_allows(threshold, bits):
    assert counter_bits(threshold) == bits
    assert CountingSketch(64, threshold, 0).cells == 64 * 8 // bits


def test_a_threshold_above_255_is_refused():
    with pytest.raises(ValueError, match="at most 255, got 256"):
        counter_bits(256)


@pytest.mark.parametrize("threshold", [2, 5, 40])
def test_estimates_never_fall_below_true_counts_and_saturate(threshold):
    # a tiny sketch: many collisions, so the estimates run ahead of the counts
    sketch = CountingSketch(32, threshold, key=3)
    gen = torch.Generator().manual_seed(0)
    true = torch.zeros(500, dtype=torch.long)
    for _ in range(60):
        ids = torch.randint(0, 500, (40,), generator=gen).unique()
        got = sketch.count(ids)
        true[ids] += 1
        assert bool((got >= true[ids].clamp(max=threshold)).all())
        assert int(got.max()) <= threshold
    assert bool((sketch.estimate(torch.arange(500)) >= true.clamp(max=threshold)).all())


def test_a_large_sketch_counts_exactly():
    sketch = CountingSketch(1 << 16, 3, key=1)
    assert sketch.count(torch.tensor([5, 9])).tolist() == [1, 1]
    assert sketch.count(torch.tensor([5])).tolist() == [2]
    assert sketch.estimate(torch.tensor([5, 9, 11])).tolist() == [2, 1, 0]


def test_fresh_ids_are_falsely_admitted_at_about_the_documented_rate():
    sketch = CountingSketch(1 << 12, 2, key=5)  # 16,384 2-bit counters
    false = 0
    for b in range(40):
        false += int((sketch.count(torch.arange(100) + 1000 * b) >= 2).sum())
    # ids counted before each: 0..3,900; the rate at the end bounds the mean
    assert 0 < false / 4000 <= false_admission_rate(1 << 12, 2, 4000)


def test_changed_chunks_and_merges_carry_counts():
    a = CountingSketch(1 << 15, 2, key=9)
    a.count(torch.arange(50), version=1)
    chunks, data = a.changed_since(0)
    assert chunks.numel() >= 1 and a.changed_since(1)[0].numel() == 0
    b = CountingSketch(1 << 15, 2, key=9)
    b.set_chunks(chunks, data, version=1)
    assert torch.equal(a.data, b.data)
    c = CountingSketch(1 << 15, 2, key=9)
    c.count(torch.arange(50, 80))
    c.merge(a.data, version=2)  # each counter at least both: every id's estimate at least its count
    assert bool((c.estimate(torch.arange(80)) >= 1).all())
