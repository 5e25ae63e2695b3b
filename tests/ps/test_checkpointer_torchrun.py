"""A parameter-server job under ``torchrun --max-restarts=1`` (tests/ps/_checkpoint_job.py: ps0,
trainer0, trainer1, a table and a local model per trainer, checkpointed every 2 of 6 steps) loses
one process to SIGKILL before a step drawn at random (2 to 5) in each run; torchrun restarts the world and the job
resumes from the newest complete checkpoint. Sync mode, batches chosen by the step index: the
end is bit for bit the uninterrupted run's (the server killed, or either trainer: trainer0 is the
one that saves the servers' part and completes the checkpoints). Async mode: the
table at restart is the checkpoint's, bit for bit (what its server wrote to its own files, read
back into a fresh table)."""

from __future__ import annotations

import json
import random
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from remote_module.ps.checkpoint._job_files import PS_FILE, STEP_DIR
from tests._deadlines import HANG_S, SETUP_S
from tests.test_torchrun import ROOT, _argv, _env

#: a job is started twice at most (its first attempt, torchrun's restart); a test runs two jobs at most
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * (2 * SETUP_S + HANG_S))]


def _job(tmp: Path, *extra: str) -> tuple[Path, Path, str]:
    """Run the job (``extra``: its options); its checkpoint directory, output directory and
    stdout."""
    ckpt, out = tmp / "ckpt", tmp / "out"
    out.mkdir(parents=True)
    command = (f"torchrun --standalone --nproc-per-node=3 --max-restarts=1 -m tests.ps._checkpoint_job "
               f"--dir {ckpt} --out {out} --steps 6 --every 2 {' '.join(extra)}")
    run = subprocess.run(_argv(command), cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=2 * SETUP_S + HANG_S)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return ckpt, out, run.stdout


def _resumed(stdout: str) -> dict[tuple[str, int], int]:
    """``{(trainer, attempt): the step it resumed from}``."""
    return {(m[1], int(m[3])): int(m[2])
            for m in re.finditer(r"^(trainer\d) resumed from step (\d+) \(attempt (\d+)\)$", stdout, re.M)}


def _restarted(stdout: str, at: int) -> int:
    """The step both trainers resumed from in torchrun's restart, the process killed before
    step ``at``: a checkpoint's (every 2 steps) at or before ``at``."""
    got = _resumed(stdout)
    assert got[("trainer0", 0)] == got[("trainer1", 0)] == 0, stdout
    start = got.get(("trainer0", 1))
    assert start is not None and got.get(("trainer1", 1)) == start, stdout  # the world was restarted
    # (2, or a later one once its files were all in before the kill; the job waits for one first)
    assert start in range(2, at + 1, 2), stdout
    return start


def _random_step() -> int:
    """The step the process is killed before: drawn anew each run (the job waits for a first
    checkpoint, at step 2, before it kills; 6 steps)."""
    at = random.SystemRandom().randint(2, 5)
    print(f"killed before step {at}")  # (pytest shows it when the test fails)
    return at


def _bit_equal(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), where
        for key in a:
            _bit_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _bit_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _ends(out: Path) -> dict[str, Any]:
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in ("trainer0", "trainer1")}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, Any]:
    _, out, stdout = _job(tmp_path_factory.mktemp("whole"))
    assert set(_resumed(stdout).values()) == {0}, stdout
    return _ends(out)


# trainer0 is the one that saves the servers' part and completes the checkpoints
@pytest.mark.parametrize("victim", ["ps0", "trainer0", "trainer1"])
def test_a_sync_job_killed_and_restarted_ends_as_uninterrupted(tmp_path, uninterrupted, victim):
    at = _random_step()
    _, out, stdout = _job(tmp_path, "--kill", victim, "--at", str(at))
    assert f"kill{'s ps0' if victim == 'ps0' else 's itself'} before step {at}" in stdout, stdout
    _restarted(stdout, at)
    got = _ends(out)
    assert "table" in got["trainer0"] and "head" in got["trainer1"]
    assert got["trainer1"]["table_lr"] == 0.3 * 0.5 ** 2  # (its scheduler's, restored: 6 steps, halved every 3)
    _bit_equal(got, uninterrupted)


def test_a_sync_job_killed_after_incremental_saves_resumes_from_one_and_ends_as_uninterrupted(tmp_path):
    # --full-every 3: the checkpoints of steps 4 and 6 are incremental saves on the one before
    # (2 is whole); ps0 killed before step 7 restarts the world from 6 or 4, an incremental one
    _, whole, _ = _job(tmp_path / "whole", "--steps", "8", "--full-every", "3")
    ckpt, out, stdout = _job(tmp_path / "killed", "--steps", "8", "--full-every", "3", "--kill", "ps0", "--at", "7")
    got = _resumed(stdout)
    start = got.get(("trainer0", 1))
    assert start in (4, 6) and got.get(("trainer1", 1)) == start, stdout
    manifest = json.loads((ckpt / STEP_DIR.format(start) / "ps" / "manifest.json").read_text())
    assert manifest["base"] is not None and manifest["tables"]["table"]["incremental"], manifest["base"]
    _bit_equal(_ends(out), _ends(whole))


def test_an_async_job_restarts_with_the_checkpoints_table(tmp_path):
    at = _random_step()
    ckpt, out, stdout = _job(tmp_path, "--mode", "async", "--hold", "--kill", "trainer1", "--at", str(at))
    start = _restarted(stdout, at)
    # the table's rows are in its server's own files (ps/ of the checkpoint), no longer in a
    # trainer's: the job read them into a fresh table (tests/ps/_checkpoint_job.py)
    held = ckpt / STEP_DIR.format(start)
    assert (held / "ps" / "manifest.json").is_file() and not (held / PS_FILE).exists(), sorted(held.rglob("*"))
    saved = torch.load(out / "checkpoint-1.pt", weights_only=False)
    at_restart = torch.load(out / "resumed-1.pt", weights_only=False)
    _bit_equal(at_restart["state"], saved["state"], "state")
    _bit_equal(at_restart["optim"], saved["optim"], "optim")
    # (and not the table the job started from: the checkpoint held trained rows)
    first = torch.load(out / "resumed-0.pt", weights_only=False)
    assert not torch.equal(first["state"]["weight"], saved["state"]["weight"])
