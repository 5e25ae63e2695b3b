"""Tables that live for months (issue 26): row admission after ``admit_after`` counted steps,
eviction of rows not stepped in ``evict_after_steps`` steps, ``table_stats()``, full and delta
checkpoints of all that state. Each compared with a reference that applies the same rules to
local tensors (SGD, 1e-6)."""

from __future__ import annotations

import pytest
import torch

from tests.ps import _lifetime_remote as r
from tests.ps._world import job


@pytest.fixture
def world(ps_world):  # shared with the other PS tests (tests/conftest.py)
    return ps_world


def reference(name: str, steps: int, num_trainers: int = 1, admit_after: int = 1,
              evict_after: int | None = None) -> torch.Tensor:
    """The rows after ``steps`` steps by the rules: each step counts its ids once (over all
    trainers); an id without a stored row is admitted once counted in ``admit_after`` steps
    (its gradient dropped before); a stored row not stepped in ``evict_after`` of the table's
    steps is dropped (read and stepped from its init). SGD on the trainers' mean gradient."""
    init = r.initial(name, torch.arange(r.ROWS))
    rows = init.clone()
    stored = torch.zeros(r.ROWS, dtype=torch.bool)
    count = torch.zeros(r.ROWS, dtype=torch.long)
    last = torch.zeros(r.ROWS, dtype=torch.long)
    clock = 0
    for s in range(steps):
        grad = torch.zeros(r.ROWS, r.DIM)
        seen = torch.zeros(r.ROWS, dtype=torch.bool)
        for t in range(num_trainers):
            ids = r.batch(s, t)
            grad.index_add_(0, ids, r.weights(s, t, ids.numel()))
            seen[ids] = True
        if evict_after is not None:
            stale = stored & (clock - last >= evict_after)
            rows[stale] = init[stale]
            stored &= ~stale
        count[seen & ~stored] += 1
        step_ids = seen & (stored | (count >= admit_after))
        rows[step_ids] -= r.LR * grad[step_ids] / num_trainers
        stored |= step_ids
        last[step_ids] = clock + 1
        clock += 1
    if evict_after is not None:
        stale = stored & (clock - last >= evict_after)
        rows[stale] = init[stale]
    return rows


def rows_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("admit_after", [2, 3])
def test_admitted_rows_train_from_their_kth_counted_step_async(world, admit_after):
    name = job(f"admit-{admit_after}")
    got = world.run({"trainer0": (r.train, name, 12, {"admit_after": admit_after})})["trainer0"]
    want = reference(name, 12, admit_after=admit_after)
    assert not torch.equal(want, reference(name, 12))  # (admission changed the rows: else this would not tell)
    rows_equal(got["rows"], want)
    stats = got["stats"]
    # rows stored: the ids admitted (hot ones, the ones seen in enough steps), not the ones seen once
    assert stats["rows_held"] == stats["rows_admitted"] < 12 + 6 * 12
    assert stats["bytes"] > r.DIM * 4 * stats["rows_held"]


def test_admission_counts_steps_not_trainers_in_sync_mode(world):
    name = job("admit-sync")
    got = world.run({f"trainer{t}": (r.train, name, 8, {"admit_after": 2}, t, 2, "sync") for t in range(2)})
    want = reference(name, 8, num_trainers=2, admit_after=2)
    for t in range(2):
        rows_equal(got[f"trainer{t}"]["rows"], want)


def test_evicted_rows_start_again_from_their_init(world):
    name = job("evict")
    got = world.run({"trainer0": (r.train, name, 14, {"evict_after_steps": 3})})["trainer0"]
    want = reference(name, 14, evict_after=3)
    assert not torch.equal(want, reference(name, 14))  # (eviction changed the rows)
    rows_equal(got["rows"], want)
    stats = got["stats"]
    assert stats["rows_evicted"] > 0
    # held: at most the rows of the last 3 steps and those not swept yet (a sweep every step here)
    assert stats["rows_held"] <= 4 * 50


def test_admission_and_eviction_together(world):
    name = job("admit-evict")
    got = world.run({"trainer0": (r.train, name, 14, {"admit_after": 2, "evict_after_steps": 4})})["trainer0"]
    rows_equal(got["rows"], reference(name, 14, admit_after=2, evict_after=4))


def test_rows_held_stay_bounded_under_a_drifting_stream(world):
    name = job("evict-drift")
    got = world.run({"trainer0": (r.train, name, 40, {"evict_after_steps": 8})})["trainer0"]
    stats = got["stats"]
    # 40 steps of ~12 new ids each: 450+ rows created; held: the hot ones and at
    # most those of the last 8 + 2 steps (swept every 2 steps), 16 each
    assert stats["rows_admitted"] > 450
    assert stats["rows_held"] <= 12 + 10 * 16, stats


@pytest.mark.parametrize("options", [{"admit_after": 2, "evict_after_steps": 3}, {"evict_after_steps": 5}, {}],
                         ids=["admit-evict", "evict", "plain"])
def test_a_checkpoint_restores_and_continues_identically(world, options):
    name = job("lifetime-restore")
    opts = {**options, "optimizer": (torch.optim.Adagrad, {"lr": 0.3})}
    got = world.run({"trainer0": (r.restore_and_continue, name, 7, 6, opts)})["trainer0"]
    a, b = got["continued"], got["restored"]
    assert torch.equal(a["rows"], b["rows"])
    for key in a["model"]:
        if key.endswith("_extra_state"):
            continue
        assert torch.equal(a["model"][key], b["model"][key]), key
    for key, value in a["optim"].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b["optim"][key]), key
    if "admit_after" in options:  # (a sketch that counted few ids is kept sparse: 32 MiB dense)
        extra = a["model"]["_extra_state"]
        assert extra["admission"] and all(data.is_sparse for _, data in extra["admission"])


@pytest.mark.parametrize("options", [
    {"optimizer": (torch.optim.Adagrad, {"lr": 0.3}), "admit_after": 2, "evict_after_steps": 3},
    {"optimizer": (torch.optim.SparseAdam, {"lr": 0.05})},
    {"optimizer": (torch.optim.Adagrad, {"lr": 0.3}), "ps_mode": "geo", "geo_push_every": 2},
], ids=["adagrad-admit-evict", "sparseadam", "geo-adagrad"])
def test_a_full_checkpoint_and_its_deltas_equal_the_full_one_at_the_end_on_other_servers(world, options):
    got = world.run({"trainer0": (r.deltas, job("deltas"), 4, 3, options)})["trainer0"]
    end, loaded = got["end"], got["loaded"]
    assert set(end["model"]) == set(loaded["model"])
    for key, value in end["model"].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, loaded["model"][key]), key
    assert set(end["optim"]) == set(loaded["optim"])
    for key, value in end["optim"].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, loaded["optim"][key]), key
        elif key == "step":
            assert value == loaded["optim"][key]
    assert all(n < 200 for n in got["sizes"]), got["sizes"]  # deltas, not whole tables
    if "evict_after_steps" in options:
        assert sum(got["evicted"]) > 0  # (tombstones were needed)


def test_a_delta_after_a_step_of_1000_rows_is_at_most_2_percent_of_a_full_checkpoint(world):
    got = world.run({"trainer0": (r.delta_bytes, job("delta-bytes"))})["trainer0"]
    assert got["rows"] == 1000
    assert got["delta"] <= 0.02 * got["full"], got


def test_a_delta_after_counting_1000_ids_carries_a_small_part_of_the_sketch(world):
    # each counted id raises 4 counters spread over the whole sketch: the chunks a delta sends
    # must be small, or every delta of an admit_after table is most of its 32 MiB sketch
    got = world.run({"trainer0": (r.admission_delta_bytes, job("delta-sketch"))})["trainer0"]
    assert got["rows"] == 0  # (counted once: not admitted)
    assert got["delta"] <= 0.05 * got["full"], got


@pytest.mark.parametrize("kwargs, words", [
    ({"admit_after": 0}, "admit_after must be a positive int"),
    ({"admit_after": -2}, "got -2"),
    ({"evict_after_steps": -1}, "evict_after_steps must be None (never evict) or a positive int, got -1"),
    ({"evict_after_steps": 0}, "got 0"),
    ({"admit_after": 300}, "at most 255, got 300"),
    ({"admit_after": 2, "init": "eager"}, "admit_after=2 needs init='lazy'"),
    ({"admit_after": 2, "ps_mode": "geo"}, "admit_after=2"),
    ({"evict_after_steps": 4, "ps_mode": "geo"}, "evict_after_steps=4"),
    ({"admit_sketch_bytes": 0}, "admit_sketch_bytes must be a positive int, got 0"),
])
def test_bad_values_raise_value_errors_naming_them(world, kwargs, words):
    got = world.run({"trainer0": (r.bad, kwargs)})["trainer0"]
    assert got.startswith("ValueError") and words in got, got


def test_a_collection_admits_and_evicts_as_its_tables_one_by_one(world):
    name = job("lifetime-collection")
    got = world.run({"trainer0": (r.collection_train, name, 10, True),
                     "trainer1": (r.collection_train, name, 10, False)})
    together, alone = got["trainer0"], got["trainer1"]
    for a, b in zip(together["outs"], alone["outs"]):
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-6)
    for k in together["rows"]:
        torch.testing.assert_close(together["rows"][k], alone["rows"][k], rtol=1e-6, atol=1e-6)
        stats = together["stats"][k]
        assert stats["rows_evicted"] > 0 and stats["rows_held"] < 28 * 3, stats
        assert stats["rows_admitted"] == alone["stats"][k]["rows_admitted"]


def test_deltas_loaded_out_of_order_are_refused(world):
    got = world.run({"trainer0": (r.delta_order, job("delta-order"))})["trainer0"]
    assert got[0] == "base: ok"
    assert got[1].startswith("second: ValueError") and "in the order delta_state_dict() returned" in got[1], got
    assert got[2:] == ["first: ok", "first again: ok", "second: ok"], got


def test_loading_a_lazy_tables_checkpoint_replaces_its_rows(world):
    name = job("lazy-load-replaces")
    got = world.run({"trainer0": (r.load_replaces, name)})["trainer0"]
    assert got["ids"] == [1, 2, 3]
    assert torch.equal(got["rows"][1:4], got["saved"])
    assert torch.equal(got["rows"][4:6], r.initial(name, torch.tensor([4, 5])))
    assert got["stats"]["rows_held"] == 3


def test_a_delta_after_a_full_checkpoint_loads_after_older_deltas(world):
    # a loader that followed deltas and then loaded a full checkpoint starts again from it: the
    # delta taken after that checkpoint loads (it was refused: it did not follow the loader's
    # last delta, whose changes the checkpoint had replaced), and the loader equals the source
    got = world.run({"trainer0": (r.delta_after_a_checkpoint, job("delta-after-full"))})["trainer0"]
    assert got["error"] is None, got["error"]
    source, loader = got["source"], got["loader"]
    assert torch.equal(source["weight.ids"], loader["weight.ids"])
    assert torch.equal(source["weight.rows"], loader["weight.rows"])
