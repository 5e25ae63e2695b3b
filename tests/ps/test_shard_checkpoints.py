"""Servers write and read their own shards (issue 44, items 1, 2 and 6 for tables):
``save_shards`` / ``load_shards`` give what ``state_dict()`` / ``load_state_dict()`` give, bit for
bit, onto another number of servers; an eager table's files are a ``torch.distributed.checkpoint``
that ``dcp.load`` reads in a plain process; a torn, truncated or corrupt checkpoint is refused
naming the file before anything changes; the trainer receives bytes that do not grow with the
rows saved."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from remote_module.ps.checkpoint._shards import _reads
from tests._deadlines import HANG_S
from tests.ps import _shard_checkpoints_remote as r
from tests.ps._world import ROOT, job
from tests.ps.test_table_checkpoints import same


@pytest.fixture
def world(ps_world):  # shared with the other PS tests (tests/conftest.py)
    return ps_world


def on(world, worker: str, fn, *args):
    return world.run({worker: (fn, *args)})[worker]


@pytest.mark.parametrize("case", sorted(r.CASES))
def test_a_shard_load_onto_three_servers_equals_a_state_dict_load_bit_for_bit(world, tmp_path, case):
    got = on(world, "trainer0", r.saved_and_loaded, job(f"shards-{case}"), case, str(tmp_path))
    # weights (or a lazy table's ids and rows), optimizer state and step count, admission counts
    # and eviction clocks (_extra_state, weight.last_step), and the rows as looked up
    same(got["shards"], got["state_dict"], case)
    if "eviction" in case:
        assert "weight.last_step" in got["shards"]["model"], sorted(got["shards"]["model"])
    if "admission" in case:
        assert got["shards"]["model"]["_extra_state"]["admission"], "no admission sketch was saved"
    manifest = got["manifest"]
    assert json.loads((tmp_path / "manifest.json").read_text()) == manifest
    # every file but the manifest is listed, with its size
    assert set(got["files"]) - {"manifest.json"} == set(manifest["files"]), got["files"]
    for rel, entry in manifest["files"].items():
        assert (tmp_path / rel).stat().st_size == entry["bytes"], rel
    # each server wrote its own files
    assert {e["server"] for e in manifest["files"].values()} == {"ps0", "ps1", None}


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_saved_on_two_servers_loaded_onto_three_continues_as_the_two_server_run_bit_for_bit(world, tmp_path, lazy):
    got = on(world, "trainer0", r.two_then_three, job("two-then-three"), str(tmp_path), lazy)
    same(got["three"], got["two"], "sync SGD, 5 steps after the load")


def _dcp_load(directory, key: str, shape: tuple) -> torch.Tensor:
    """``dcp.load`` of ``key`` into a local nn.EmbeddingBag's state dict, in a fresh process
    that never starts a process group: the weight read."""
    script = textwrap.dedent(f"""
        import sys, warnings, torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        warnings.simplefilter("ignore")
        assert not (dist.is_available() and dist.is_initialized())
        model = torch.nn.ModuleDict({{{key.split('.')[0]!r}: torch.nn.EmbeddingBag({shape[0]}, {shape[1]})}})
        state = model.state_dict()
        assert list(state) == [{key!r}], list(state)
        dcp.load(state, checkpoint_id=sys.argv[1])
        torch.save(state[{key!r}], sys.argv[2])
    """)
    out = os.path.join(directory, "..", "dcp-read.pt")
    subprocess.run([sys.executable, "-c", script, str(directory), out], check=True, cwd=ROOT, timeout=120)
    return torch.load(out)


def test_dcp_load_reads_an_eager_tables_checkpoint_into_a_local_embedding_bag_bit_for_bit(world, tmp_path):
    directory = tmp_path / "ckpt"
    got = on(world, "trainer0", r.eager_weight, job("dcp"), str(directory))
    read = _dcp_load(directory, "emb.weight", (r.ROWS, r.DIM))
    assert read.dtype == got["weight"].dtype and torch.equal(read, got["weight"])


def test_a_collection_round_trips_with_its_tables_under_their_names(world, tmp_path):
    got = on(world, "trainer0", r.collection_round_trip, job("collection"), str(tmp_path))
    assert sorted(got["manifest"]["tables"]) == ["ebc.a", "ebc.b"]
    assert got["manifest"]["tables"]["ebc.b"]["dcp_key"] == "ebc.b.weight"
    assert got["manifest"]["tables"]["ebc.a"]["dcp_key"] is None  # (lazy: by id only)
    same(got["target"], got["source"], "collection")


def _flip_one_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


@pytest.mark.parametrize("fault", ["flipped byte in ps1's rows", "truncated ps0 weights", "missing ps1 weights",
                                   "flipped byte in the trainer's file"])
def test_a_corrupt_or_truncated_shard_is_refused_naming_it_before_any_server_changes(world, tmp_path, fault):
    manifest = on(world, "trainer0", r.saved, job("corrupt"), str(tmp_path))
    rel = {"flipped byte in ps1's rows": "emb.ps1.pt", "truncated ps0 weights": "emb.ps0.distcp",
           "missing ps1 weights": "emb.ps1.distcp", "flipped byte in the trainer's file": "emb.trainer.pt"}[fault]
    assert rel in manifest["files"]
    if fault.startswith("flipped"):
        _flip_one_byte(tmp_path / rel)
    elif fault.startswith("truncated"):
        _truncate(tmp_path / rel)
    else:
        (tmp_path / rel).unlink()
    got = on(world, "trainer1", r.refused_load, job("corrupt-load"), str(tmp_path), ["ps0", "ps1", "ps2"])
    assert got["error"] is not None and got["error"].startswith("CheckpointError"), got["error"]
    assert str(tmp_path / rel) in got["error"], got["error"]
    why = {"flipped": "checksum is crc32:", "truncated": "truncated", "missing": "missing"}[fault.split()[0]]
    assert why in got["error"], got["error"]
    same(got["after"], got["before"], "unchanged")


def _as_version_1(directory) -> None:
    """Rewrite the checkpoint's manifest as a build before CRC-32 wrote it: version 1, each
    file's SHA-256 under "sha256"."""
    from remote_module.ps._shard_io import file_sha256
    from remote_module.ps.checkpoint._manifest import SELF_SHA256, _body_sha256

    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.pop(SELF_SHA256)
    manifest["version"] = 1
    for rel, entry in manifest["files"].items():
        assert entry.pop("checksum").startswith("crc32:")
        entry["sha256"] = file_sha256(directory / rel)
    manifest[SELF_SHA256] = _body_sha256(manifest)
    path.write_text(json.dumps(manifest, indent=1, sort_keys=True))


@pytest.mark.parametrize("flipped", [False, True])
def test_a_checkpoint_of_the_sha256_manifest_version_still_loads_and_is_still_checked(world, tmp_path, flipped):
    got = on(world, "trainer0", r.eager_weight, job("version-1"), str(tmp_path))
    _as_version_1(tmp_path)
    if flipped:
        _flip_one_byte(tmp_path / "emb.ps1.distcp")
    loaded = on(world, "trainer1", r.refused_load, job("version-1-load"), str(tmp_path), ["ps0", "ps1", "ps2"])
    if flipped:
        assert loaded["error"] is not None and "emb.ps1.distcp: its checksum is sha256:" in loaded["error"], \
            loaded["error"]
        same(loaded["after"], loaded["before"], "unchanged")
    else:
        assert loaded["error"] is None, loaded["error"]
        assert torch.equal(loaded["after"]["model"]["weight"], got["weight"])


def _rewrite_manifest(directory, change) -> None:
    """``change(manifest)`` written back with the manifest's own checksum made to fit (as a
    build that wrote it so would have written it)."""
    from remote_module.ps.checkpoint._manifest import SELF_SHA256, _body_sha256

    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.pop(SELF_SHA256)
    change(manifest)
    manifest[SELF_SHA256] = _body_sha256(manifest)
    path.write_text(json.dumps(manifest, indent=1, sort_keys=True))


@pytest.mark.parametrize("checksum", ["md5:0123456789abcdef", None], ids=["unknown kind", "none"])
def test_a_file_listed_with_a_checksum_of_unknown_kind_or_none_is_refused_naming_it(world, tmp_path, checksum):
    on(world, "trainer0", r.eager_weight, job("checksum-kind"), str(tmp_path))

    def change(manifest):
        entry = manifest["files"]["emb.ps1.distcp"]
        del entry["checksum"]
        if checksum is not None:
            entry["checksum"] = checksum

    _rewrite_manifest(tmp_path, change)
    got = on(world, "trainer1", r.refused_load, job("checksum-kind-load"), str(tmp_path), ["ps0", "ps1", "ps2"])
    assert got["error"] is not None and got["error"].startswith("CheckpointError"), got["error"]
    assert "emb.ps1.distcp" in got["error"], got["error"]
    assert ("unknown kind, 'md5:" if checksum else "no checksum") in got["error"], got["error"]
    same(got["after"], got["before"], "unchanged")


def test_a_checkpoint_without_its_manifest_is_torn_and_refused(world, tmp_path):
    on(world, "trainer0", r.saved, job("torn"), str(tmp_path))
    (tmp_path / "manifest.json").unlink()  # (as a save killed before its last write leaves it)
    got = on(world, "trainer1", r.refused_load, job("torn-load"), str(tmp_path), ["ps0", "ps1"])
    assert got["error"] is not None and got["error"].startswith("CheckpointError"), got["error"]
    assert "manifest.json" in got["error"] and "torn" in got["error"], got["error"]
    same(got["after"], got["before"], "unchanged")


def test_a_table_that_does_not_fit_is_refused_before_anything_changes(world, tmp_path):
    on(world, "trainer0", r.saved, job("misfit"), str(tmp_path), "eager-sparse-adam-eviction")
    got = on(world, "trainer1", r.refused_load, job("misfit-load"), str(tmp_path), ["ps0", "ps1"], "eager-sgd")
    assert got["error"] is not None and got["error"].startswith("ValueError"), got["error"]
    assert "SparseAdam" in got["error"] and "SGD" in got["error"], got["error"]
    same(got["after"], got["before"], "unchanged")


def test_the_local_layout_writes_each_servers_files_in_its_own_folder_and_loads_onto_the_same_servers(
        world, tmp_path):
    got = on(world, "trainer0", r.local_layout, job("local"), str(tmp_path))
    files = got["files"]
    assert sorted(files["ps0"]) == ["emb.ps0.distcp", "emb.ps0.pt"], files
    assert sorted(files["ps1"]) == ["emb.ps1.distcp", "emb.ps1.pt"], files
    # the trainer's own files stay at the top; no server wrote there
    assert {n for n, sub in files.items() if sub is None} == {".metadata", "emb.trainer.pt", "manifest.json"}, files
    same(got["loaded"], got["saved"], "local layout, same servers")
    # what each server is told to read at a load: its own folder's files only
    entry, listed = got["manifest"]["tables"]["emb"], got["manifest"]["files"]
    for server, blocks in got["blocks"].items():
        reads = _reads(entry, listed, server, blocks, "local", True)
        assert reads.files and all(f.rel.startswith(f"{server}/") for f in reads.files), (server, reads)
    # (in the shared layout the same servers would read the other's files too: its blocks overlap)
    assert {f.rel for f in _reads(entry, listed, "ps0", [(0, r.ROWS)], "shared", True).files} == {
        rel for rel, e in listed.items() if e["server"] is not None}


def test_a_local_checkpoint_onto_other_servers_is_refused_saying_the_shared_layout_is_needed(world, tmp_path):
    on(world, "trainer0", r.saved, job("local-other"), str(tmp_path), "eager-sgd", "local")
    got = on(world, "trainer1", r.refused_load, job("local-other-load"), str(tmp_path), ["ps0", "ps1", "ps2"])
    assert got["error"] is not None and got["error"].startswith("CheckpointError"), got["error"]
    assert "local layout" in got["error"] and "layout='shared'" in got["error"], got["error"]
    same(got["after"], got["before"], "unchanged")


def test_objects_other_than_tables_or_names_that_collide_are_refused(world, tmp_path):
    got = on(world, "trainer0", r.unsupported, job("unsupported"), str(tmp_path))
    assert got["linear"].startswith("TypeError") and "ShardedEmbeddingBagCollection" in got["linear"], got
    assert "Linear" in got["linear"] and "PSModel" in got["linear"], got
    assert got["collide"].startswith("ValueError") and "'a.b'" in got["collide"], got
    # one table under two names would load half of each checkpoint: refused before any call
    assert got["twice"].startswith("ValueError") and "is given twice ('a', 'b')" in got["twice"], got
    assert not (tmp_path / "manifest.json").exists()


def test_the_trainer_receives_bytes_that_do_not_grow_with_the_rows_saved_and_loaded(world, tmp_path):
    # a lazy table of 10**8 rows (dim 16) holding 2 000, then 20 000 rows: what passes through
    # the trainer is the manifest's worth (tests/benchmarks/bench_shard_checkpoints.py: 10**6 rows)
    small = on(world, "trainer0", r.trainer_bytes, job("bytes-small"), str(tmp_path / "small"), 2000)
    large = on(world, "trainer0", r.trainer_bytes, job("bytes-large"), str(tmp_path / "large"), 20000)
    assert small["held"] == 2000 and large["held"] == 20000
    for what in ("save", "load"):
        for side in ("received", "sent"):
            assert large[what][side] < 64 * 1024, (what, side, large)
            # 10x the rows (1.2 MB more of them): a few bytes more (digits of sizes)
            assert abs(large[what][side] - small[what][side]) < 2048, (what, side, small, large)


def test_a_save_over_an_earlier_one_in_the_same_directory_loads_the_later(world, tmp_path):
    first = on(world, "trainer0", r.eager_weight, job("over-1"), str(tmp_path))
    second = on(world, "trainer0", r.eager_weight, job("over-2"), str(tmp_path))
    assert not torch.equal(first["weight"], second["weight"])
    got = on(world, "trainer1", r.refused_load, job("over-load"), str(tmp_path), ["ps1", "ps2"])
    assert got["error"] is None, got["error"]
    assert torch.equal(got["after"]["model"]["weight"], second["weight"])


@pytest.fixture(scope="module")
def losing():
    """A world of its own (a server is killed in it): driver, ps0-ps2, trainer0."""
    from tests.ps._world import PSWorld

    with PSWorld({"ps": 3, "trainer": 1}) as w:
        yield w


def test_a_server_lost_during_a_save_leaves_it_torn_and_the_previous_checkpoint_loads(losing, tmp_path):
    previous, torn = tmp_path / "previous", tmp_path / "torn"
    name = job("lost-server")
    # (the tables' timeout only bounds the hang guard: a killed rank's connection fails at once)
    saved = on(losing, "trainer0", r.saved_before_a_loss, name, str(previous), HANG_S)
    losing.kill("ps1")
    error = on(losing, "trainer0", r.save_with_a_server_lost, name, str(torn))
    assert error is not None and "ps1" in error, error
    assert not (torn / "manifest.json").exists()
    # ps0 wrote its blocks without waiting for ps1 (no collective among servers)
    deadline = time.monotonic() + HANG_S
    while not (torn / "emb.ps0.pt").exists():
        assert time.monotonic() < deadline, sorted(os.listdir(torn))
        time.sleep(0.05)
    got = on(losing, "trainer0", r.load_after_a_loss, name, str(torn), str(previous))
    assert got["error"] is not None and got["error"].startswith("CheckpointError") and "torn" in got["error"]
    # the servers left (ps0, ps2) hold what was saved before the loss (shared layout: any servers)
    for part in ("model", "optim"):
        same(got["loaded"][part], saved[part], part)


def test_two_trainers_loading_one_table_at_once_both_load_it(world, tmp_path):
    # each server stages each load apart: one trainer's load never replaces the other's
    saved = on(world, "trainer0", r.eager_weight, job("together"), str(tmp_path))
    name = job("together-load")
    got = world.run({t: (r.load_repeatedly, name, str(tmp_path), 4) for t in ("trainer1", "trainer2")})
    for trainer, outcome in got.items():
        assert outcome["errors"] == [], (trainer, outcome["errors"])
        assert torch.equal(outcome["after"]["model"]["weight"], saved["weight"]), trainer


def test_a_save_over_an_eager_checkpoint_leaves_no_torch_metadata_of_the_old_weights(world, tmp_path):
    # the old .metadata would let dcp.load read the old eager weights from a lazy (or torn) save
    got = on(world, "trainer0", r.eager_then_lazy, job("eager-then-lazy"), str(tmp_path))
    assert "manifest.json" in got["files"] and ".metadata" not in got["files"], got["files"]


def test_a_manifest_edited_on_disk_is_refused_before_anything_changes(world, tmp_path):
    on(world, "trainer0", r.saved, job("edited"), str(tmp_path), "eager-sparse-adam-eviction")
    path = tmp_path / "manifest.json"
    manifest = json.loads(path.read_text())
    key = next(iter(manifest["tables"]))
    manifest["tables"][key]["optimizer_steps"] += 100  # (SparseAdam's bias correction would change)
    path.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    got = on(world, "trainer1", r.refused_load, job("edited-load"), str(tmp_path), ["ps0", "ps1"],
             "eager-sparse-adam-eviction")
    assert got["error"] is not None and got["error"].startswith("CheckpointError"), got["error"]
    assert "manifest.json: its text does not match its own sha256" in got["error"], got["error"]
    same(got["after"], got["before"], "unchanged")


def test_a_staged_load_whose_trainer_gave_up_is_forgotten_at_a_later_stage():
    from remote_module.ps.tables.server import _shard_files as files

    late, current = ("t", "late"), ("t", "current")
    files._staged.update({late: None, current: None, ("t", "untimed"): None})
    files._expires.update({late: time.monotonic() - 1, current: time.monotonic() + HANG_S, ("t", "untimed"): None})
    try:
        files._forget_expired()
        assert late not in files._staged and late not in files._expires
        assert current in files._staged and ("t", "untimed") in files._staged
    finally:
        for load in (late, current, ("t", "untimed")):
            files._staged.pop(load, None)
            files._expires.pop(load, None)


@pytest.mark.parametrize("fault", ["flipped", "truncated"])
def test_the_job_checkpointer_saves_tables_as_shards_and_skips_a_damaged_one_for_the_previous(world, tmp_path, fault):
    held = on(world, "trainer0", r.job_checkpointed, job("job-ckpt"), str(tmp_path))
    assert held.pop("kept after close") == {"ps0": 0, "ps1": 0}
    newest = tmp_path / "step-00000004"
    # the servers wrote the rows in ps/; the job's manifest lists ps/manifest.json, which lists them
    listed = json.loads((newest / "manifest.json").read_text())["files"]
    shards = json.loads((newest / "ps" / "manifest.json").read_text())["files"]
    assert "ps/manifest.json" in listed and "emb.ps1.pt" in shards and "ps/emb.ps1.pt" not in listed, listed
    assert not (newest / "ps.pt").exists()
    # a byte flipped (its size holds: the server finds it by its checksum as it loads) or a shard cut short
    # (the trainer finds it by size): nothing of it is loaded, the step-2 checkpoint is, bit for bit
    (_flip_one_byte if fault == "flipped" else _truncate)(newest / "ps" / "emb.ps1.pt")
    got = on(world, "trainer0", r.job_resumed, job("job-ckpt-resumed"), str(tmp_path))
    assert got["start"] == 2, got["warnings"]
    assert any(str(newest) in w and "ps/emb.ps1.pt" in w for w in got["warnings"]), got["warnings"]
    same(got["table"], held[2], "resumed from step 2")


def test_a_background_save_writes_the_snapshot_while_the_table_trains_on(world, tmp_path):
    # each server's writer is held on a gate: the save's files are written only after 6 more steps
    got = on(world, "trainer0", r.saved_in_the_background, job("background"), str(tmp_path), HANG_S)
    assert not got["done_while_held"] and not got["torn_while_held"]
    changed = any(not torch.equal(a, b) for a, b in zip(got["trained_on"]["model"].values(),
                                                         got["at_save"]["model"].values())
                  if isinstance(a, torch.Tensor))
    assert changed, "training after the snapshot changed nothing: the test could not tell"
    for part in ("model", "optim"):  # what the save began with, bit for bit: not what came after
        same(got["loaded"][part], got["at_save"][part], part)
    assert json.loads((tmp_path / "manifest.json").read_text()) == got["manifest"]


def test_snapshots_into_memory_kept_from_the_last_save_are_what_each_save_began_with(world, tmp_path):
    # the second save begins while the first waits to be written: its snapshot may not reuse the
    # first's memory; the third reuses what the first two kept once written
    got = on(world, "trainer0", r.saves_into_kept_memory, job("kept"), str(tmp_path / "a"), str(tmp_path / "b"),
             HANG_S)
    assert all(kept > 0 for kept in got["kept"].values()), got["kept"]
    assert got["released"] == {"ps0": 0, "ps1": 0}
    for i, (loaded, at) in enumerate(zip(got["loaded"], got["at"])):
        for part in ("model", "optim"):
            same(loaded[part], at[part], f"save {i}: {part}")
    assert any(not torch.equal(a, b) for a, b in zip(got["at"][0]["model"].values(), got["at"][2]["model"].values())
               if isinstance(a, torch.Tensor)), "training between the saves changed nothing: the test could not tell"


def test_a_snapshot_into_kept_memory_copies_only_the_rows_changed_and_saves_them_all(world, tmp_path):
    got = on(world, "trainer0", r.saves_of_few_changed_rows, job("kept-partial"), str(tmp_path))
    # each server (one block): the first save copied it whole into fresh memory (none was kept),
    # the next two only the rows changed since into the memory the one before kept
    assert got["copied"] == {"ps0": {"partial": 2, "whole": 1}, "ps1": {"partial": 2, "whole": 1}}, got["copied"]
    for i, (loaded, at) in enumerate(zip(got["loaded"], got["at"])):
        same(loaded, at, f"save {i}")
    assert not torch.equal(got["at"][0]["model"]["weight"], got["at"][2]["model"]["weight"])


def test_a_background_write_that_fails_is_raised_by_wait_naming_the_files(world, tmp_path):
    error = on(world, "trainer0", r.failed_background_write, job("failed-write"), str(tmp_path))
    assert error is not None and "ps1" in error and "emb.ps1" in error, error
    assert not (tmp_path / "manifest.json").exists()  # torn: never loaded


def test_a_manifest_is_written_with_the_permissions_of_the_other_files(tmp_path):
    # (another user who reads the shard files reads the manifest too: not mkstemp's 0600)
    from remote_module.ps.checkpoint._manifest import write_atomically

    write_atomically(str(tmp_path / "manifest.json"), b"{}")
    (tmp_path / "other.pt").write_bytes(b"")
    assert (tmp_path / "manifest.json").stat().st_mode == (tmp_path / "other.pt").stat().st_mode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "other.pt"]  # (no temporary left)


def test_a_save_begun_into_a_directory_another_save_is_writing_refuses_the_first(world, tmp_path):
    # both servers' writes go to the same file names: the first save's manifest would list files
    # the second overwrote; it is refused, the second completes and loads
    got = on(world, "trainer0", r.two_saves_into_one_directory, job("two-saves"), str(tmp_path))
    assert got["first"] is not None and got["first"].startswith("CheckpointError") and "another save" in got["first"]
    assert got["second"] is None and got["same"], got
    assert not (tmp_path / ".save-id").exists()
