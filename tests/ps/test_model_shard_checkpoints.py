"""PSModels saved and loaded through their dense servers' own files (issue 44, item 1 for
PSModels): ``save_shards`` / ``load_shards`` give what ``state_dict()`` /
``optimizer_state_dict()`` and their loads give, bit for bit, in every mode, onto another
number of servers (shared layout), and training goes on as from a state_dict load; a corrupt or
truncated file is refused naming it before anything changes; what the trainer receives does not
grow with the model; the job's Checkpointer saves PSModels in ``ps/`` (no ``ps.pt``) and still
reads a ``ps.pt`` of an older checkpoint."""

from __future__ import annotations

import json

import pytest

from tests.ps import _model_shard_checkpoints_remote as r
from tests.ps._world import job
from tests.ps.test_table_checkpoints import same


@pytest.fixture
def world(ps_world):  # shared with the other PS tests (tests/conftest.py)
    return ps_world


def on(world, worker: str, fn, *args):
    return world.run({worker: (fn, *args)})[worker]


@pytest.mark.parametrize("servers", [["ps0", "ps1"], ["ps0", "ps1", "ps2"]], ids=["two", "three"])
@pytest.mark.parametrize("case", sorted(r.CASES))
def test_a_shard_load_equals_a_state_dict_load_bit_for_bit_and_training_goes_on_the_same(world, tmp_path, case,
                                                                                        servers):
    got = on(world, "trainer0", r.saved_and_loaded, job(f"model-shards-{case}"), case, str(tmp_path), servers)
    # parameters, buffers (BatchNorm's running statistics), optimizer state, ps_optimizer settings
    # (geo: the trainer's optimizer and its progress since its last push)
    same(got["shards"], got["state_dict"], f"{case}: loaded")
    same(got["shards"], got["saved"], f"{case}: as saved")
    # four steps more: as after a state_dict load, and as the model saved went on
    same(got["after"]["shards"], got["after"]["state_dict"], f"{case}: trained on")
    same(got["after"]["shards"], got["after"]["source"], f"{case}: trained on, against the saved model's run")
    manifest = got["manifest"]
    assert json.loads((tmp_path / "manifest.json").read_text()) == manifest
    assert set(got["files"]) - {"manifest.json"} == set(manifest["files"]), got["files"]
    for rel, entry in manifest["files"].items():
        assert (tmp_path / rel).stat().st_size == entry["bytes"], rel
    # each server wrote its own blocks; the trainer only its small file and the manifest
    assert {rel: e["server"] for rel, e in manifest["files"].items()} == {
        "model.ps0.pt": "ps0", "model.ps1.pt": "ps1", "model.trainer.pt": None}
    entry = manifest["models"]["model"]
    assert manifest["objects"] == {"model": {"kind": "model", "tables": []}}
    assert entry["optimizer"] == r.CASES[case]["optimizer"][0].__name__ and entry["ps_mode"] == r.CASES[case]["ps_mode"]
    assert entry["parameters"]["0.weight"] == {"shape": [r.HIDDEN, r.IN], "dtype": "torch.float32"}
    assert {b[4] for b in entry["blocks"]} == {"ps0", "ps1"}


def _flip_one_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("fault", ["flipped byte in ps1's blocks", "truncated ps0 blocks", "missing ps1 blocks",
                                   "flipped byte in the trainer's file"])
def test_a_corrupt_or_truncated_file_is_refused_naming_it_before_any_server_changes(world, tmp_path, fault):
    manifest = on(world, "trainer0", r.saved, job("model-corrupt"), str(tmp_path))
    rel = {"flipped byte in ps1's blocks": "model.ps1.pt", "truncated ps0 blocks": "model.ps0.pt",
           "missing ps1 blocks": "model.ps1.pt", "flipped byte in the trainer's file": "model.trainer.pt"}[fault]
    assert rel in manifest["files"]
    path = tmp_path / rel
    if fault.startswith("flipped"):
        _flip_one_byte(path)
    elif fault.startswith("truncated"):
        path.write_bytes(path.read_bytes()[:-7])
    else:
        path.unlink()
    # onto three servers: every server reads some of each saved server's blocks
    got = on(world, "trainer1", r.refused_load, job("model-corrupt-load"), str(tmp_path), ["ps0", "ps1", "ps2"])
    assert got["error"] is not None and got["error"].startswith("CheckpointError"), got["error"]
    assert str(path) in got["error"], got["error"]
    why = {"flipped": "checksum is crc32:", "truncated": "truncated", "missing": "missing"}[fault.split()[0]]
    assert why in got["error"], got["error"]
    same(got["after"], got["before"], "unchanged")


def test_a_model_that_does_not_fit_is_refused_before_anything_changes(world, tmp_path):
    on(world, "trainer0", r.saved, job("model-misfit"), str(tmp_path), "adam-async")
    other = on(world, "trainer1", r.refused_load, job("model-misfit-sgd"), str(tmp_path), ["ps0", "ps1"],
               "sgd-momentum-sync")
    assert other["error"] is not None and other["error"].startswith("ValueError"), other["error"]
    assert "'Adam'" in other["error"] and "'SGD'" in other["error"], other["error"]
    same(other["after"], other["before"], "unchanged")
    wider = on(world, "trainer1", r.wider, job("model-misfit-wider"), str(tmp_path), ["ps0", "ps1"])
    assert wider["error"] is not None and wider["error"].startswith("ValueError"), wider["error"]
    assert "size mismatch for model.0.weight" in wider["error"], wider["error"]
    same(wider["after"], wider["before"], "unchanged")


def test_the_local_layout_writes_each_servers_blocks_in_its_own_folder_and_loads_only_onto_the_same_blocks(
        world, tmp_path):
    got = on(world, "trainer0", r.local_layout, job("model-local"), str(tmp_path))
    assert got["files"] == {"manifest.json": None, "model.trainer.pt": None, "ps0": ["model.ps0.pt"],
                            "ps1": ["model.ps1.pt"]}, got["files"]
    same(got["loaded"], got["saved"], "local layout, same servers")
    refused = on(world, "trainer1", r.refused_load, job("model-local-other"), str(tmp_path), ["ps0", "ps1", "ps2"])
    assert refused["error"] is not None and refused["error"].startswith("CheckpointError"), refused["error"]
    assert "local layout" in refused["error"] and "layout='shared'" in refused["error"], refused["error"]
    same(refused["after"], refused["before"], "unchanged")


def test_the_trainer_receives_bytes_that_do_not_grow_with_the_model(world, tmp_path):
    # 64 x 64 (16 KB of weights) and 512 x 512 (1 MB, and Adam's two moments): what passes
    # through the trainer is the manifest's worth; through state_dict() it is the model
    small = on(world, "trainer0", r.trainer_bytes, job("model-bytes-small"), str(tmp_path / "small"), 64)
    large = on(world, "trainer0", r.trainer_bytes, job("model-bytes-large"), str(tmp_path / "large"), 512)
    assert large["state_dict"]["received"] > 3 * 512 * 512 * 4, large  # (the measure sees the model's bytes)
    for what in ("save", "load"):
        for side in ("received", "sent"):
            assert large[what][side] < 16 * 1024, (what, side, large)
            assert abs(large[what][side] - small[what][side]) < 2048, (what, side, small, large)


@pytest.mark.parametrize("case", ["sgd-momentum-sync", "adam-async"])  # (geo: Checkpointer refuses it)
def test_the_job_checkpointer_saves_a_psmodel_in_its_servers_files_and_resumes_it_bit_for_bit(world, tmp_path, case):
    held = on(world, "trainer0", r.job_checkpointed, job(f"model-job-{case}"), str(tmp_path), case)
    newest = tmp_path / "step-00000004"
    assert not (newest / "ps.pt").exists()
    shards = json.loads((newest / "ps" / "manifest.json").read_text())
    assert shards["objects"] == {"model": {"kind": "model", "tables": []}}
    assert {"model.ps0.pt", "model.ps1.pt"} <= set(shards["files"]), shards["files"]
    got = on(world, "trainer0", r.job_resumed, job(f"model-job-{case}-resumed"), str(tmp_path), case)
    assert got["start"] == 4
    same(got["model"], held[4], "resumed from step 4 (onto three servers)")


def test_a_job_checkpoint_with_psmodels_in_ps_pt_still_loads(world, tmp_path):
    got = on(world, "trainer0", r.old_ps_file_loaded, job("model-old-ps-pt"), str(tmp_path), "adam-async")
    same(got["loaded"], got["saved"], "ps.pt")


def test_the_tables_inside_a_psmodel_are_saved_as_tables_and_the_whole_loads_as_a_state_dict_load(world, tmp_path):
    got = on(world, "trainer0", r.with_table, job("model-with-table"), str(tmp_path))
    assert got["manifest"]["objects"] == {"model": {"kind": "model", "tables": ["emb"]}}
    assert sorted(got["manifest"]["tables"]) == ["model.emb"]
    assert {rel for rel, e in got["manifest"]["files"].items() if e["server"] is not None} >= {
        "model.ps0.pt", "model.ps1.pt", "model.emb.ps0.pt"}, got["manifest"]["files"]
    assert "emb.weight" in got["saved"]["model"] and "emb" in got["saved"]["optim"]["tables"]
    same(got["shards"], got["state_dict"], "loaded")
    same(got["after"]["shards"], got["after"]["state_dict"], "trained on")
