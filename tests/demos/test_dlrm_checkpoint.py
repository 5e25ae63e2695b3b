"""The demo's ``--checkpoint DIR --every N`` (remote_module/demos/dlrm.py): a run that ended is
started again with more ``--steps`` and resumes from its newest checkpoint, saying so, and the
command line refuses what does not go together."""

import pytest

from remote_module.demos import dlrm as dlrm_demo
from remote_module.ps.checkpoint._job_files import complete_checkpoints


@pytest.mark.slow
def test_a_run_started_again_resumes_from_its_newest_checkpoint(capfd, tmp_path):
    argv = ["--servers", "1", "--trainers", "2", "--no-progress", "--plot", "", "--checkpoint", str(tmp_path),
            "--every", "2"]
    first = dlrm_demo.main(argv + ["--steps", "4"])
    out = capfd.readouterr().out
    assert "resumed from step" not in out and [r["steps"] for r in first] == [4, 4], out
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [2, 4]
    again = dlrm_demo.main(argv + ["--steps", "6"])
    out = capfd.readouterr().out
    assert f"resumed from step 4 (the newest checkpoint in {tmp_path})" in out, out
    assert "training 2 steps of" in out, out
    # the figures are this run's: its 2 steps
    assert [(r["steps"], len(r["losses"]), r["auc_curve"][-1][0]) for r in again] == [(2, 2, 6)] * 2
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [4, 6]  # the newest 2 kept
    # the summary's line: trainer0 saved once (step 6), and its size is the checkpoint's on disk
    figures = again[0]["checkpoints"]
    assert figures["resumed_from"] == 4 and figures["saves"] == figures["completed"] == 1, figures
    saved = tmp_path / "step-00000006"  # (the servers' shard files, in ps/, among them)
    assert (saved / "ps" / "manifest.json").is_file() and not (saved / "ps.pt").exists()
    on_disk = sum(p.stat().st_size for p in saved.rglob("*") if p.is_file() and p != saved / "manifest.json")
    assert figures["bytes"] == on_disk, figures
    assert f"checkpoints: resumed from step 4; 1 save, {on_disk / 1e6:.1f} MB each, " in out, out


@pytest.mark.slow
def test_full_every_saves_the_checkpoints_between_full_ones_incrementally_and_resumes_from_one(capfd, tmp_path):
    argv = ["--servers", "2", "--trainers", "1", "--no-progress", "--plot", "", "--checkpoint", str(tmp_path),
            "--every", "2", "--full-every", "2"]
    first = dlrm_demo.main(argv + ["--steps", "4"])
    out = capfd.readouterr().out
    figures = first[0]["checkpoints"]
    assert figures["saves"] == figures["completed"] == 2 and figures["incremental"] == 1, figures
    assert "2 saves, 1 of them incremental; the newest " in out, out
    full, incremental = (tmp_path / f"step-{s:08d}" / "ps" for s in (2, 4))
    shards = [sum(p.stat().st_size for p in d.glob("*.ps*")) for d in (full, incremental)]
    assert shards[1] < shards[0], shards  # (4 steps of a batch touch few of the tables' rows)
    again = dlrm_demo.main(argv + ["--steps", "6"])
    out = capfd.readouterr().out
    assert "resumed from step 4 (the newest checkpoint in" in out, out
    assert again[0]["checkpoints"]["incremental"] == 0  # (the first save after a resume is whole)


def test_every_defaults_to_100_with_a_checkpoint(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert dlrm_demo.parse_args(["--checkpoint", "d"]).every == 100
    assert dlrm_demo.parse_args([]).every is None
