"""remote_module.ps.Checkpointer without servers (one trainer, local state only): a run stopped
and resumed ends bit for bit as an uninterrupted one (model, optimizer, scheduler, a generator,
the global RNGs); checkpoints appear only once complete, ``keep`` bounds them, a torn one is
never loaded and a corrupted one is skipped with a warning naming it. The job-wide case (servers,
several trainers, torchrun restarts) is tests/ps/test_checkpointer_torchrun.py."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from remote_module.ps import Checkpointer
from remote_module.ps.checkpoint import _checkpointer
from remote_module.ps.checkpoint._job_files import MANIFEST, complete_checkpoints
from tests._deadlines import SETUP_S

ROOT = Path(__file__).resolve().parents[2]
STEPS, EVERY = 7, 2


def _objects(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return {"model": model, "opt": opt, "sched": torch.optim.lr_scheduler.StepLR(opt, 2, 0.5),
            "gen": torch.Generator().manual_seed(7)}


def _run(path: Path, stop: int | None = None, keep: int = 3, drain: bool = True) -> tuple[int, dict]:
    """A job of STEPS steps checkpointing every EVERY into ``path``; ``stop``: it ends before
    that step without closing (killed; ``drain``: once the checkpointer's own thread finished
    what it began). Returns the step it resumed from and its objects."""
    objs = _objects()
    torch.manual_seed(1234)  # a new process's RNGs: the resume must restore the saved ones
    random.seed(1234)
    ckpt = Checkpointer(path, every_steps=EVERY, keep=keep, local=objs)
    start = ckpt.resume()
    for k in range(start, STEPS):
        if k == stop:  # killed here (no close()), once the checkpointer's own thread finished what it began:
            if drain:  # (the tests below look at the directory; a resume here waits for it anyway)
                ckpt._drain_quietly()
            return start, objs
        # the batch draws from the objects' generator, torch's global RNG and Python's random
        x = torch.randn(4, 3, generator=objs["gen"]) + 0.1 * torch.randn(4, 3) + random.random()
        loss = objs["model"](x).pow(2).mean()
        objs["opt"].zero_grad()
        loss.backward()
        objs["opt"].step()
        objs["sched"].step()
        ckpt.step()
    ckpt.close()
    return start, objs


def _same(a: dict, b: dict) -> None:
    for key, value in a["model"].state_dict().items():
        assert torch.equal(value, b["model"].state_dict()[key]), key
    sa, sb = a["opt"].state_dict(), b["opt"].state_dict()
    for i, state in sa["state"].items():
        assert torch.equal(state["momentum_buffer"], sb["state"][i]["momentum_buffer"])
    assert sa["param_groups"] == sb["param_groups"]
    assert a["sched"].state_dict() == b["sched"].state_dict()
    assert torch.equal(a["gen"].get_state(), b["gen"].get_state())


def _steps(path: Path) -> list[int]:
    return [step for step, _ in complete_checkpoints(path)]


@pytest.fixture(autouse=True)
def no_rpc_world_here(monkeypatch):
    """These are jobs without an RPC world (this process is the only trainer). The pytest
    process may be a rank of the test session's own world (tests/conftest.py): the Checkpointer
    must not see it (it would ask for ``trainers=``). The test of a world runs in a subprocess."""
    monkeypatch.setattr(_checkpointer, "_in_rpc_world", lambda: False)


def test_a_stopped_run_resumes_bit_for_bit(tmp_path):
    _, whole = _run(tmp_path / "whole")
    assert _steps(tmp_path / "whole") == [2, 4, 6]
    first, _ = _run(tmp_path / "cut", stop=5)
    assert first == 0 and _steps(tmp_path / "cut") == [2, 4]
    start, resumed = _run(tmp_path / "cut")
    assert start == 4
    _same(resumed, whole)
    assert _steps(tmp_path / "cut") == [2, 4, 6]


def test_keep_bounds_the_checkpoints(tmp_path):
    _run(tmp_path, keep=1)
    assert _steps(tmp_path) == [6]
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000006"]


def test_a_torn_checkpoint_is_never_loaded_and_goes_at_resume(tmp_path):
    _run(tmp_path, stop=5)
    # a save killed halfway: its staging directory, never renamed
    torn = tmp_path / ".step-00000006.tmp"
    torn.mkdir()
    (torn / "trainer-0.pt").write_bytes(b"half")
    start, _ = _run(tmp_path)
    assert start == 4 and not torn.exists() and _steps(tmp_path) == [2, 4, 6]


@pytest.mark.parametrize("damage", ["truncated", "corrupted", "no manifest"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(tmp_path, damage):
    _, whole = _run(tmp_path / "whole")
    _run(tmp_path / "cut", stop=5)
    newest = tmp_path / "cut" / "step-00000004"
    file = newest / "trainer-0.pt"
    if damage == "truncated":
        file.write_bytes(file.read_bytes()[:-10])
    elif damage == "corrupted":
        data = bytearray(file.read_bytes())
        data[len(data) // 2] ^= 0xFF
        file.write_bytes(bytes(data))
    else:
        (newest / MANIFEST).unlink()
    with pytest.warns(RuntimeWarning, match=r"checkpoint .*step-00000004 is not loadable: ") as caught:
        start, resumed = _run(tmp_path / "cut")
    why = str(caught[0].message)
    assert {"truncated": "truncated", "corrupted": "checksum", "no manifest": "no manifest.json"}[damage] in why, why
    assert start == 2
    _same(resumed, whole)  # the steps since step 2 trained again: the same end


def test_no_loadable_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    _run(tmp_path, stop=3)
    (tmp_path / "step-00000002" / MANIFEST).unlink()
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="no checkpoint under .* is loadable"):
        _run(tmp_path)


def test_another_local_name_is_refused_naming_it(tmp_path):
    _run(tmp_path, stop=3)
    ckpt = Checkpointer(tmp_path, every_steps=EVERY, local={"other": nn.Linear(3, 1)})
    with pytest.raises(KeyError, match=r"no local state \['other'\]"):
        ckpt.resume()


def test_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="every_steps must be"):
        Checkpointer(tmp_path, every_steps=0)
    with pytest.raises(ValueError, match="keep must be"):
        Checkpointer(tmp_path, every_steps=1, keep=0)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="full_every must be"):
            Checkpointer(tmp_path, every_steps=1, full_every=bad)
    with pytest.raises(TypeError, match=r"local\['x'\] must have state_dict"):
        Checkpointer(tmp_path, every_steps=1, local={"x": 3})
    with pytest.raises(TypeError, match=r"ps\['t'\] must be a table"):
        Checkpointer(tmp_path, every_steps=1, ps={"t": nn.Linear(1, 1)})
    ckpt = Checkpointer(tmp_path, every_steps=1)
    with pytest.raises(RuntimeError, match="call resume"):
        ckpt.step()


def test_a_trainer_that_never_saves_times_out_naming_it_and_trainers_are_known(tmp_path):
    # the first of two trainers, alone in a one-rank RPC world: the second's file never comes,
    # so completing the checkpoint fails within the timeout, naming it, and nothing is visible
    out = subprocess.run([sys.executable, "-m", "tests.ps._checkpointer_script", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=SETUP_S)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "TimeoutError: checkpoint of step 1" in out.stdout and "no state from trainer1 within" in out.stdout, (
        out.stdout
    )
    assert complete_checkpoints(tmp_path) == []
    assert "ValueError: this RPC world was not formed by rpc_backend" in out.stdout and "pass trainers=" in out.stdout


def test_save_twice_at_one_step_saves_once(tmp_path):
    ckpt = Checkpointer(tmp_path, every_steps=1, local={"model": nn.Linear(2, 1)})
    ckpt.resume()
    ckpt.step()
    assert ckpt.save() == tmp_path / ".step-00000001.tmp"  # (already saved by step())
    ckpt.close()
    assert _steps(tmp_path) == [1] and [p.name for p in tmp_path.iterdir()] == ["step-00000001"]


def test_a_resume_in_the_process_of_a_stopped_job_waits_for_its_background_completion(tmp_path):
    # the stopped job's thread may still be completing step 4's checkpoint (manifest, rename)
    # when the next job of the same path resumes in this process: the resume waits for it, so
    # it neither removes a staging directory being completed nor misses the checkpoint
    _, whole = _run(tmp_path / "whole")
    for attempt in range(5):
        cut = tmp_path / f"cut{attempt}"
        _run(cut, stop=5, drain=False)
        start, resumed = _run(cut)
        assert start == 4, attempt
        _same(resumed, whole)


class _ServersSave:
    """Stands for the servers' save of a checkpoint (what ``_begin_ps`` returns): not written
    until ``wait()``, which records that it ran."""

    def __init__(self, log: list) -> None:
        self.log, self.write_s, self.waited = log, 0.0, False

    def add_done_callback(self, callback) -> None:
        pass

    def done(self) -> bool:
        return self.waited

    def wait(self) -> dict:
        self.waited = True
        return {}


def test_a_save_begins_only_once_the_servers_wrote_the_one_before(tmp_path, monkeypatch):
    # the servers hold one snapshot at a time: a save waits for the previous one's write
    begun: list[_ServersSave] = []

    def begin_ps(path, objects, timeout=None, keep_snapshot_s=0.0, **chain):
        begun.append(_ServersSave(begun))
        return begun[-1]

    monkeypatch.setattr(_checkpointer, "_begin_ps", begin_ps)
    seen, kept = [], []
    real_begin = begin_ps

    def checked(path, objects, timeout=None, keep_snapshot_s=0.0, **chain):
        seen.append([b.waited for b in begun])  # (each earlier save's write waited for, when this one begins)
        kept.append(keep_snapshot_s)
        return real_begin(path, objects, timeout, keep_snapshot_s)

    monkeypatch.setattr(_checkpointer, "_begin_ps", checked)
    ckpt = Checkpointer(tmp_path, every_steps=1, keep=5)
    ckpt.resume()
    for _ in range(4):
        ckpt.step()
    ckpt.close()
    assert seen == [[], [True], [True, True], [True, True, True]]
    # the servers keep a snapshot's memory for the next save (at least KEEP_SNAPSHOT_MIN_S)
    assert kept and all(k >= _checkpointer.KEEP_SNAPSHOT_MIN_S for k in kept), kept
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [1, 2, 3, 4]


def test_a_closed_checkpointer_saves_no_more(tmp_path):
    ckpt = Checkpointer(tmp_path, every_steps=1, local={"model": nn.Linear(2, 1)})
    ckpt.resume()
    ckpt.step()
    ckpt.close()
    ckpt.close()  # (twice: nothing more)
    for call in (ckpt.step, ckpt.save):
        with pytest.raises(RuntimeError, match="was closed"):
            call()
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [1]
