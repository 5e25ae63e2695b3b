"""Parameter servers under failing workers (issue 11, item 6): a trainer killed in sync mode
and a server killed. Their own small world (tests/ps/_world.py: driver, ps0, ps1, trainer0,
trainer1), since ranks die in it; the trainer is killed first, then the server."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from tests._deadlines import HANG_S, SETUP_S
from tests.ps import _dense_remote as r
from tests.ps import _in_flight_remote as rr
from tests.ps._stalls import assert_stalled
from tests.ps._world import PSWorld

TIMEOUT = 2.0
SERVERS = ["ps0", "ps1"]
#: a script that starts its own world, trains and ends it: a hang guard, no time limit
SCRIPT_S = SETUP_S + HANG_S

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def world():
    with PSWorld({"ps": 2, "trainer": 2}) as w:
        yield w


def assert_failed_naming(outcome: dict, worker: str, what: str) -> None:
    """The call failed naming ``worker``, which is dead for good (killed before the call: no
    late answer of it can have ended the call). The only bound on its time is a hang guard:
    a call that never ends fails the test there (the world's own RPC timeout is longer)."""
    assert not outcome["ok"], f"{what} succeeded although {worker} is dead: {outcome}"
    assert f"'{worker}'" in outcome["message"], f"{what}: the error does not name {worker!r}: {outcome['message']}"
    assert outcome["seconds"] < TIMEOUT + HANG_S, f"{what}: hang guard: no end within timeout + {HANG_S} s: {outcome}"


@pytest.fixture(scope="module")
def trainer_killed(world):
    """Sync job on both trainers; trainer1 killed; trainer0 pushes step 0 (in flight), then
    pulls for step 1: the pull lands the push, whose answer waits for step 0 to be applied
    (it times out naming trainer1), and a second pull waits for it again. The job's timeout is
    set once it is built and trained (the calls that must not time out do not have it).

    On a loaded machine the servers' answer may come after the push's own deadline: the pull
    then fails by the call's own timeout, and the trainer, which cannot tell that its push
    counted, keeps the step as a failed push (its gradients put back for a retry, the step not
    counted; tests/ps/test_in_flight_edges.py checks that state deterministically). Its second
    pull is then a read at step 0, which waits for nothing: it gets a hang guard's timeout, and
    ``kept`` says whether the gradients were put back."""
    name = "sync-trainer-killed"
    world.call(r.create_on, ["trainer0", "trainer1"], name, ("net", 1, SERVERS),
               dict(num_trainers=2, min_block_size=4))
    world.kill("trainer1")
    world.run({"trainer0": (r.forward_backward, name, 0)})
    world.run({"trainer0": (r.set_timeout, name, TIMEOUT)})
    step = world.run({"trainer0": (r.attempt, name, "send")})["trainer0"]
    pull = world.run({"trainer0": (r.attempt, name, "pull")})["trainer0"]
    kept = world.run({"trainer0": (rr.has_gradients, name)})["trainer0"]
    if not _servers_answer(pull):  # the pull's own timeout: step 0 kept as a failed push
        world.run({"trainer0": (r.set_timeout, name, HANG_S)})
    again = world.run({"trainer0": (r.attempt, name, "pull")})["trainer0"]
    return {"step": step, "pull": pull, "kept": kept, "again": again}


def _servers_answer(outcome: dict) -> bool:
    """Whether a failed landing of the sync step got the servers' answer (the step not applied
    in time: the push counted), not the call's own timeout (the answer came too late)."""
    return "was not applied in time" in outcome.get("message", "")


@pytest.mark.parametrize("which", ["pull", "again"])
def test_a_trainer_killed_in_sync_mode_fails_the_others_pull_naming_it(world, trainer_killed, which):
    assert trainer_killed["step"]["ok"], f"pushing step 0 needs no other trainer: {trainer_killed['step']}"
    if which == "again" and not _servers_answer(trainer_killed["pull"]):
        # the first pull failed by its own timeout (a loaded machine): step 0 is a failed push,
        # kept for a retry, and a pull at step 0 waits for nothing (the servers' wait for the
        # push still failed at its deadline, naming trainer1: checked below)
        assert trainer_killed["kept"], f"the failed push's gradients were not put back: {trainer_killed}"
        assert trainer_killed["again"]["ok"], f"a pull at step 0 after a failed push: {trainer_killed}"
        assert_stalled(world, trainer_killed["pull"], "sync-trainer-killed", "the pull waiting for step 0", TIMEOUT)
        return
    if which == "again":
        assert not trainer_killed["kept"], f"a push that counted had its gradients put back: {trainer_killed}"
    # the sync wait for step 0 reached its deadline on the servers naming trainer1 (not trainer0)
    assert_stalled(world, trainer_killed[which], "sync-trainer-killed", f"the {which} waiting for step 0", TIMEOUT)


@pytest.fixture(scope="module")
def server_killed(world):
    """One-trainer jobs in every pushing mode, gradients ready; ps1 killed; then step and pull."""
    modes = ("sync", "async", "half_async")
    for mode in modes:
        world.call(r.create_on, ["trainer0"], f"server-killed-{mode}", ("net", 1, SERVERS),
                   dict(num_trainers=1, ps_mode=mode, min_block_size=4))
        world.run({"trainer0": (r.forward_backward, f"server-killed-{mode}", 0)})
        world.run({"trainer0": (r.set_timeout, f"server-killed-{mode}", TIMEOUT)})
    world.kill("ps1")
    return {(mode, what): world.run({"trainer0": (r.attempt, f"server-killed-{mode}", what)})["trainer0"]
            for mode in modes for what in ("step", "pull")}


@pytest.mark.parametrize("mode", ["sync", "async", "half_async"])
@pytest.mark.parametrize("what", ["step", "pull"])
def test_a_killed_server_is_named_by_step_and_pull_within_the_timeout(trainer_killed, server_killed, mode, what):
    assert_failed_naming(server_killed[(mode, what)], "ps1", f"{what} in {mode} mode")


def test_a_last_step_whose_pushes_fail_unawaited_is_reported_when_the_process_ends():
    """trainer0's last call on two PSModels is a step() whose pushes fail (a server-side
    optimizer refusing NaN gradients; a sync step the other trainer never pushes) and nothing
    waits for them: local torch would have raised at that step, so the process warns of each
    as it ends (its own process: the world ends)."""
    proc = subprocess.run([sys.executable, "-m", "tests.ps._unlanded_script"], capture_output=True, text=True,
                          timeout=SCRIPT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warned = [line for line in proc.stderr.splitlines() if "RuntimeWarning: the pushes of a last step() failed" in line]
    assert len(warned) == 2, proc.stderr[-3000:]
    assert "to get its outcome): RefusingSGD: a NaN gradient" in proc.stderr, proc.stderr[-3000:]
    # the sync step's timeout: the server's wait for its step (naming the job), or, when that
    # answer comes after the step's own deadline on a loaded machine, that deadline (its 1 s:
    # the other job's is a hang guard)
    assert any(("'unlanded-sync'" in line and "not applied in time" in line)
               or "no answer within 1 s (timeout=1 s)" in line for line in warned), warned


def test_geo_flush_pushes_the_last_local_steps_and_steps_never_pushed_are_reported():
    """geo: 5 steps with geo_push_every=3 leave 2 local steps after the last push. flush()
    pushes them: the servers then hold what one local process trained (a PSModel with a table,
    and a table alone), which they did not before. Two jobs that end with local steps never
    pushed (no flush) are warned of as the process ends (a user who forgets the step only the
    distributed version needs is told), and the flushed ones are not."""
    proc = subprocess.run([sys.executable, "-m", "tests.ps._geo_flush_script"], capture_output=True, text=True,
                          timeout=SCRIPT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("geo-flush "))
    got = ast.literal_eval(line[len("geo-flush "):])
    assert got["before"]["dense"] > 1e-3 and got["before"]["alone"] > 1e-3, got  # the last 2 steps not pushed yet
    assert got["after"]["dense"] <= 1e-6 and got["after"]["alone"] <= 1e-6, got  # flush() pushed them
    assert got["model"] <= 1e-6, got  # pulled back: the dense part and its table equal the local process
    assert got["unpushed_saved"] == 2, got
    warned = [x for x in proc.stderr.splitlines() if "RuntimeWarning:" in x and "never pushed" in x]
    assert len(warned) == 2, proc.stderr[-3000:]
    for what in ("PSModel 'geo-left' (geo) ended with 2 local optimizer step(s) never pushed",
                 "table 'geo-left-bag' (geo) ended with 2 trained row(s) never pushed"):
        assert any(what in x for x in warned), warned


def test_geo_flush_pushes_the_deltas_a_failed_boundary_push_kept():
    """geo: the push at a geo_push_every boundary fails on one server, whose blocks keep their
    deltas for the next push (documented). flush() after the last step must push them, as it
    pushes the steps since the last push: the servers then hold what one local process
    trained. A job left so, never flushed, is warned of as the process ends."""
    proc = subprocess.run([sys.executable, "-m", "tests.ps._geo_flush_failed_script"], capture_output=True,
                          text=True, timeout=SCRIPT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("geo-flush-failed "))
    got = ast.literal_eval(line[len("geo-flush-failed "):])
    assert got["geo-flush-failed"]["raised"] and got["geo-flush-failed-left"]["raised"], got
    assert got["geo-flush-failed"]["after"] <= 1e-6, got
    warned = [x for x in proc.stderr.splitlines() if "RuntimeWarning:" in x and "never pushed" in x]
    assert len(warned) == 1 and "PSModel 'geo-flush-failed-left' (geo)" in warned[0], proc.stderr[-3000:]
