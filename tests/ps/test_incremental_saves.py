"""Incremental saves in the shard layout (issue 44, item 1: "the existing delta checkpoints
become incremental saves in the same layout"): a save with ``base=`` holds each table's rows
changed since its base, by id, and a load of it reads the chain; it loads as a full save taken
at the same point does, bit for bit, onto another number of servers; a broken chain is refused
naming the missing link, before anything changes."""

from __future__ import annotations

import shutil

import pytest

from tests.ps import _incremental_remote as r
from tests.ps._shard_checkpoints_remote import CASES
from tests.ps._world import job
from tests.ps.test_table_checkpoints import same


@pytest.fixture
def world(ps_world):  # shared with the other PS tests (tests/conftest.py)
    return ps_world


def on(world, worker: str, fn, *args):
    return world.run({worker: (fn, *args)})[worker]


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_last_of_a_chain_of_incremental_saves_loads_as_a_full_save_bit_for_bit(world, tmp_path, case):
    got = on(world, "trainer0", r.chain_and_full, job(f"chain-{case}"), case, str(tmp_path))
    first, *incremental = got["manifests"]
    assert first["base"] is None and first["token"] == "chain"
    assert not first["tables"]["emb"]["incremental"]
    for i, manifest in enumerate(incremental):
        entry = manifest["tables"]["emb"]
        parts = [part["since"] is not None for part in entry["servers"].values()]
        assert entry["incremental"] == any(parts) and (manifest["base"] is None) == (not any(parts)), manifest
        if entry["incremental"]:
            assert manifest["base"]["path"] == f"../s{i}", manifest["base"]
            assert entry["dcp_key"] is None  # (torch's reader reads full saves only)
        # every server's changes by id; but in the eager eviction case, where every row a step
        # leaves alone is evicted (back to its first value: a change) within the second
        # interval, a server whose rows all changed writes its blocks whole
        assert all(parts) or (case == "eager-sparse-adam-eviction" and i == 1), (i, parts)
    assert incremental[0]["tables"]["emb"]["incremental"]
    # loaded onto three servers: what a full save taken at the same point loads, bit for bit
    # (rows, optimizer state and step count, admission counts, eviction clocks), and the same
    # after three more steps
    same(got["chain"], got["full"], f"{case}: chain vs full")
    if case == "eager-sgd":  # (elsewhere a row created or evicted restarts from its table name's first value)
        same(got["chain after"], got["full after"], f"{case}: after 3 steps")
    same(got["full"]["optim"], got["source"]["optim"], f"{case}: full vs source")


def test_an_incremental_save_holds_only_the_rows_changed_since_its_base(world, tmp_path):
    got = on(world, "trainer0", r.few_rows_changed, job("few-rows"), str(tmp_path))
    first, second = got["first"], got["second"]
    assert "emb.ps0.distcp" in first["files"] and "emb.ps0.distcp" not in second["files"]
    rows_first = sum(e["bytes"] for rel, e in first["files"].items() if rel.startswith("emb.ps"))
    rows_second = sum(e["bytes"] for rel, e in second["files"].items() if rel.startswith("emb.ps"))
    assert rows_second < rows_first, (rows_second, rows_first)
    # one step of 12 ids changes at most 12 of the 60 rows
    changed = sum(part["state_rows"] for part in second["tables"]["emb"]["servers"].values())
    assert 0 < changed <= 12, changed


def test_an_eager_table_whose_rows_mostly_changed_is_saved_whole_not_by_id(world, tmp_path):
    manifest = on(world, "trainer0", r.most_rows_changed, job("most-rows"), str(tmp_path))
    # by id, each changed row would take 8 bytes more than whole: every server wrote its blocks
    # whole, so the save names no base (and torch's reader reads it)
    assert manifest["base"] is None and not manifest["tables"]["emb"]["incremental"], manifest["base"]
    assert manifest["tables"]["emb"]["dcp_key"] == "emb.weight"
    assert "emb.ps0.distcp" in manifest["files"] and "emb.ps1.distcp" in manifest["files"]


def test_a_chain_missing_its_base_or_with_a_base_saved_again_is_refused_naming_it(world, tmp_path):
    got = on(world, "trainer0", r.chain_then_load, job("chain-broken"), str(tmp_path))
    s0, s1, s2 = got["saves"]
    loaded = on(world, "trainer1", r.load_or_error, job("chain-ok"), s2)
    assert loaded["error"] is None
    same(loaded["after"], got["checkpoint"], "the chain loaded")
    # the base's manifest gone (torn): refused naming it, nothing changed
    (tmp_path / "s0" / "manifest.json").rename(tmp_path / "s0" / "manifest.json.away")
    refused = on(world, "trainer1", r.load_or_error, job("chain-torn"), s2)
    assert refused["error"].startswith("CheckpointError") and s0 in refused["error"], refused["error"]
    same(refused["after"], refused["before"], "nothing loaded")
    (tmp_path / "s0" / "manifest.json.away").rename(tmp_path / "s0" / "manifest.json")
    # the middle link saved again since: its manifest differs from the one the last recorded
    on(world, "trainer0", r.chain_then_load, job("chain-again"), str(tmp_path / "other"))
    shutil.rmtree(tmp_path / "s1")
    shutil.copytree(tmp_path / "other" / "s1", tmp_path / "s1")
    refused = on(world, "trainer1", r.load_or_error, job("chain-again-load"), s2)
    assert refused["error"].startswith("CheckpointError") and "saved again since" in refused["error"], \
        refused["error"]
    assert s1 in refused["error"]
    same(refused["after"], refused["before"], "nothing loaded")


def test_a_corrupt_file_of_a_base_is_refused_naming_it_before_anything_changes(world, tmp_path):
    got = on(world, "trainer0", r.chain_then_load, job("chain-corrupt-base"), str(tmp_path))
    data = bytearray((tmp_path / "s0" / "emb.ps1.distcp").read_bytes())
    data[len(data) // 2] ^= 1
    (tmp_path / "s0" / "emb.ps1.distcp").write_bytes(bytes(data))
    refused = on(world, "trainer1", r.load_or_error, job("chain-corrupt-base-load"), got["saves"][2])
    assert refused["error"].startswith("CheckpointError") and "emb.ps1.distcp" in refused["error"], \
        refused["error"]
    same(refused["after"], refused["before"], "nothing loaded")


def test_bad_bases_and_tokens_are_refused_before_anything_is_written(world, tmp_path):
    got = on(world, "trainer0", r.refused_saves, job("chain-refused"), str(tmp_path))
    expected = {"no token": "ValueError: an incremental save (base=...) needs the token",
                "other token": "ValueError: ", "base without token": "ValueError: ",
                "torn base": "CheckpointError: ", "itself": "ValueError: base is the directory saved into",
                "other layout": "ValueError: ", "empty token": "ValueError: token must be a non-empty str"}
    for label, start in expected.items():
        assert got[label] is not None and got[label].startswith(start), (label, got[label])
        assert not got[label + " wrote"], label
    assert "saved with token None, not 't'" in got["base without token"]
    # a base on a base that is gone: refused naming the missing link, nothing written
    assert got["broken base"].startswith("CheckpointError: base ") and "does not load" in got["broken base"]
    assert not got["broken base wrote"]
    # saving into a directory that the base is an incremental save on would break the base's chain
    assert got["base on the target"].startswith("ValueError: base ") and "is an incremental save on" in \
        got["base on the target"], got["base on the target"]
    assert "saved with token 't', not 'u'" in got["other token"]


def test_a_server_whose_table_was_made_again_writes_its_blocks_whole_and_the_save_names_no_base(world, tmp_path):
    got = on(world, "trainer0", r.after_a_new_table, job("chain-new-life"), str(tmp_path))
    manifest = got["manifest"]
    assert manifest["base"] is None and not manifest["tables"]["emb"]["incremental"]
    assert all(part["since"] is None for part in manifest["tables"]["emb"]["servers"].values())
    same(got["loaded"], got["saved"], "whole again")


@pytest.mark.parametrize("case", ["eager-sgd", "lazy-adagrad-admission-eviction"])
def test_a_checkpointer_with_full_every_saves_chains_keeps_their_bases_and_resumes_from_the_newest(
        world, tmp_path, case):
    got = on(world, "trainer0", r.job_with_chains, job(f"job-chain-{case}"), str(tmp_path), case, 12, 3, 2)
    # saves at 2 (full), 4, 6 (on the one before), 8 (full), 10, 12: keep=2 keeps 10 and 12, and
    # 8, the full save they are incremental on
    assert got["left"] == ["step-00000008", "step-00000010", "step-00000012"], got["left"]
    assert got["bases"] == {"step-00000008": None, "step-00000010": "../../step-00000008/ps",
                            "step-00000012": "../../step-00000010/ps"}, got["bases"]
    assert got["stats"]["incremental"] == 4 and got["stats"]["completed"] == 6, got["stats"]
    # closed: the servers keep no dropped ids for its chain any more
    assert got["chains after close"] == {"ps0": [], "ps1": []}, got["chains after close"]
    resumed = on(world, "trainer0", r.job_resumed_and_trained, job(f"job-chain-{case}-resumed"), str(tmp_path),
                 case, 12, 3)
    assert resumed["start"] == 12 and not resumed["warnings"], resumed
    same(resumed["resumed"], got["held"][12], f"{case}: resumed from an incremental save")


def test_a_job_resumed_from_an_incremental_save_ends_as_the_run_that_was_not_stopped(world, tmp_path):
    straight = on(world, "trainer0", r.job_with_chains, job("job-chain-straight"), str(tmp_path), "eager-sgd",
                  16, 3, 8)
    for step in (14, 16):  # (as if killed after step 13: the newest is 12, incremental on 10, on 8)
        shutil.rmtree(tmp_path / f"step-{step:08d}")
    resumed = on(world, "trainer0", r.job_resumed_and_trained, job("job-chain-straight-resumed"), str(tmp_path),
                 "eager-sgd", 16, 3)
    assert resumed["start"] == 12 and not resumed["warnings"], resumed
    # (eager SGD without eviction: every row comes from the checkpoint, none from the table's name)
    same(resumed["end"], straight["held"][16], "resumed at 12 and trained to 16")


def test_a_checkpointer_whose_newest_base_is_damaged_falls_back_past_its_chain(world, tmp_path):
    got = on(world, "trainer0", r.job_with_chains, job("job-chain-damaged"), str(tmp_path), "eager-sgd", 12, 3, 4)
    # keep=4 keeps 6 to 12, and 2 and 4, the saves 6 is incremental on
    assert got["left"] == [f"step-{s:08d}" for s in (2, 4, 6, 8, 10, 12)], got["left"]
    # the full save of 8 damaged: 10 and 12 (incremental on it) and 8 are refused, 6 loads
    data = bytearray((tmp_path / "step-00000008" / "ps" / "emb.ps0.distcp").read_bytes())
    data[len(data) // 2] ^= 1
    (tmp_path / "step-00000008" / "ps" / "emb.ps0.distcp").write_bytes(bytes(data))
    resumed = on(world, "trainer0", r.job_resumed_and_trained, job("job-chain-damaged-resumed"), str(tmp_path),
                 "eager-sgd", 6, 3)
    assert resumed["start"] == 6, resumed["warnings"]
    assert len(resumed["warnings"]) == 3 and all("emb.ps0.distcp" in w for w in resumed["warnings"]), \
        resumed["warnings"]
    same(resumed["resumed"], got["held"][6], "resumed from step 6")


def test_a_checkpointer_whose_base_no_longer_loads_saves_the_next_one_whole(world, tmp_path):
    # (it used to raise at every save from then on: the job never saved again)
    got = on(world, "trainer0", r.job_whose_base_was_lost, job("job-base-lost"), str(tmp_path))
    assert got["bases"] == {"step-00000004": None, "step-00000006": "../../step-00000004/ps"}, got["bases"]
    assert len(got["warnings"]) == 1 and "step-00000002" in got["warnings"][0], got["warnings"]


def test_a_job_resumed_past_a_damaged_base_keeps_its_new_checkpoints(world, tmp_path):
    on(world, "trainer0", r.job_with_chains, job("keep-after-fallback"), str(tmp_path), "eager-sgd", 12, 3, 1)
    # 12 (on 10, on 8) kept with its bases; 10 damaged: resume falls back to 8
    data = bytearray((tmp_path / "step-00000010" / "ps" / "emb.ps0.pt").read_bytes())
    data[len(data) // 2] ^= 1
    (tmp_path / "step-00000010" / "ps" / "emb.ps0.pt").write_bytes(bytes(data))
    got = on(world, "trainer0", r.resumed_and_resumed_again, job("keep-after-fallback-resumed"), str(tmp_path),
             10, 3, 1)
    # the checkpoint of 10 saved again is kept (it used to be removed at once, with 8: the
    # refused 12 counted as the newest, and a crash then found nothing loadable)
    assert got["start"] == 8 and got["again"] == 10, got
    assert got["left"] == ["step-00000010", "step-00000012"], got["left"]


def test_a_checkpointer_given_a_table_twice_is_refused_when_built_not_at_its_first_save(world, tmp_path):
    # (a table alone and in a collection, or a collection beside the PSModel holding it: the
    # first save refused it, every_steps steps of training later)
    got = on(world, "trainer0", r.checkpointer_given_a_table_twice, job("given-twice"), str(tmp_path / "c"))
    assert got["at"] == "built", got
    assert "is given twice ('emb', 'all.emb')" in got["error"], got
    assert got["left"] == [], got


def test_a_checkpointer_whose_full_base_was_removed_by_hand_says_to_put_it_back(world, tmp_path):
    got = on(world, "trainer0", r.job_with_chains, job("job-chain-removed"), str(tmp_path), "eager-sgd", 12, 3, 2)
    assert got["left"] == [f"step-{s:08d}" for s in (8, 10, 12)], got["left"]
    shutil.rmtree(tmp_path / "step-00000008")  # (a cleanup keeping "the newest two")
    error = on(world, "trainer0", r.resume_error, job("job-chain-removed-resumed"), str(tmp_path))
    assert error is not None and error.startswith("RuntimeError: "), error
    assert "step-00000008" in error and "put back one removed by hand" in error, error
    assert error.endswith("move them away to start afresh"), error


def test_end_save_chain_has_the_servers_keep_no_dropped_ids_for_it(world, tmp_path):
    got = on(world, "trainer0", r.chain_ended, job("chain-ended"), str(tmp_path))
    assert got["before"] == {"ps0": ["save_shards t"], "ps1": ["save_shards t"]}, got
    assert got["after"] == {"ps0": [], "ps1": []}, got
