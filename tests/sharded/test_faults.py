"""The sharded layer under failing workers (issue 10, item 5: "a worker that died: error names it
within the timeout; no hang"): a slow shard, a burst from several caller threads, a mesh worker
frozen with SIGSTOP and one killed with SIGKILL, and a graceful ``rpc.shutdown()`` mid-burst.
They need processes of their own: one world for the faults, in turn (tests/_faults/sharded_world.py,
mode ``faults``: caller + w1, w2, w3), and one for the shutdown (mode ``shutdown``).

No check here depends on the machine's speed: a failure "within the timeout" is one that came
while the fault still held (the world thaws a frozen worker, or opens a held shard's gate,
only once every call's outcome is in; a killed one stays dead), naming the faulty worker. The
only upper bounds on time are hang guards (tests/_deadlines.py)."""

from __future__ import annotations

import pytest

from tests._deadlines import HANG_S
from tests._faults import sharded_world as sfw
from tests._faults.subworld import run_report

pytestmark = [pytest.mark.slow]

#: the fault world's phases, one after the other (each waits for its late work to settle)
WORLD_S = 4 * HANG_S


@pytest.fixture(scope="module")
def faults():
    return run_report("tests._faults.sharded_world", list(sfw.ROLES["faults"]), timeout=WORLD_S, args=("faults",))


def phase(report: dict, name: str) -> dict:
    result = report[name]
    assert "error" not in result, f"phase {name!r} failed in the world:\n{result['error']}"
    return result


def assert_failed_naming(outcome: dict, worker: str, what: str) -> None:
    """``outcome`` (the world ran it while ``worker`` was down or held) failed, naming it."""
    assert not outcome["ok"], f"{what} succeeded although {worker} was down: {outcome}"
    assert outcome["seconds"] < outcome["timeout"] + HANG_S, f"{what}: hang guard: {outcome}"
    assert f"'{worker}'" in outcome["message"], f"{what}: the error does not name {worker!r}: {outcome['message']}"


def assert_no_leak(report: dict, baseline: dict, workers: list[str]) -> None:
    assert report["held_after"] == {w: baseline[w] for w in workers}, (
        f"shards left on the workers once the late work ran: {report['held_after']} (before: {baseline})"
    )


def test_a_shard_slower_than_the_timeout_is_named_and_its_outputs_do_not_leak(faults):
    report = phase(faults, "slow")
    outcome = report["forward"]
    assert_failed_naming(outcome, "w2", "the forward")
    assert outcome["type"] == "CallTimeout", outcome
    # w2's shard was still held on its gate when the forward failed: no late answer of w2's ended it
    assert outcome["held"], f"the forward failed before w2's shard was held: {outcome}"
    assert "'w1'" not in outcome["message"] and "'w3'" not in outcome["message"], outcome["message"]
    # the slow shard finished after the caller gave up: its output (and the others') were freed
    assert_no_leak(report, faults["baseline"], ["w1", "w2", "w3"])
    assert report["after"]["ok"] and report["after"]["value"], report["after"]


def test_a_burst_from_four_threads_gets_each_its_own_answer_and_leaks_nothing(faults):
    report = phase(faults, "burst")
    assert report["alive"] == 0, f"{report['alive']} caller threads still run: {report}"
    assert report["errors"] == [], report["errors"]
    assert report["wrong"] == [], f"(thread, call, got) with another input's answer: {report['wrong']}"
    assert_no_leak(report, faults["baseline"], ["w1", "w2", "w3"])


FAILING = ("forward", "full_tensor", "local_shards", "redistribute", "peer_fetch")


@pytest.mark.parametrize("what", FAILING)
def test_a_frozen_worker_is_named_within_the_timeout(faults, what):
    report = phase(faults, "frozen")
    assert_failed_naming(report[what], "w2", what)
    if what == "peer_fetch":  # w1's own fetch from w2 failed, not the caller's call to w1
        assert "_piece" in report[what]["message"] and "'w1'" in report[what]["message"], report[what]["message"]


def test_healthy_workers_work_while_one_is_frozen_and_its_late_outputs_do_not_leak(faults):
    report = phase(faults, "frozen")
    assert report["healthy"]["ok"] and report["healthy"]["value"], f"work on [w1, w3]: {report['healthy']}"
    assert report["after"]["ok"] and report["after"]["value"], f"after SIGCONT: {report['after']}"
    assert_no_leak(report, faults["baseline"], ["w1", "w2", "w3"])


@pytest.mark.parametrize("what", ("forward",) + ("again",) + FAILING[1:])
def test_a_killed_worker_is_named_within_the_timeout(faults, what):
    report = phase(faults, "killed")
    assert_failed_naming(report[what], "w3", what)


def test_healthy_workers_work_after_one_was_killed_and_nothing_leaks_on_them(faults):
    report = phase(faults, "killed")
    assert report["healthy"]["ok"] and report["healthy"]["value"], f"work on [w1, w2]: {report['healthy']}"
    # RemoteTensors spanning the dead w3 were dropped: their shards on w1 and w2 are freed
    assert_no_leak(report, faults["baseline"], ["w1", "w2"])


def test_a_graceful_shutdown_mid_burst_answers_calls_already_made_and_does_not_hang():
    report = run_report("tests._faults.sharded_world", list(sfw.ROLES["shutdown"]), timeout=2 * HANG_S,
                        args=("shutdown",))
    assert "error" not in report, report["error"]
    ops, index = report["ops"], report["in_flight"]
    assert report["unanswered_at_shutdown"], f"the forward {index} was answered before rpc.shutdown(): {ops[index]}"
    assert not report["thread_alive"], f"calls still hang after rpc.shutdown() returned: {ops[-3:]}"
    assert report["shutdown_seconds"] < HANG_S, f"hang guard: rpc.shutdown() took {report['shutdown_seconds']} s"
    # every call made before the shutdown was answered, and answered right (a forward: an output
    # of the right shape; a fetch: equal to the local reference)
    before = ops[: index + 1]
    assert all(op["made"] < 0 for op in before), before
    for i, op in enumerate(before):
        assert op["ok"], f"call {i} ({op['kind']}), made before rpc.shutdown(), failed: {op}"
        assert op["value"] is True, f"call {i} answered wrongly: {op}"
    # calls made during or after it fail, or succeed correctly: never a wrong value
    for i, op in enumerate(ops[index + 1:], index + 1):
        assert not op["ok"] or op["value"] is True, f"call {i} answered wrongly: {op}"
    # the releaser (shards dropped just before and after) neither crashed nor broke the shutdown
    assert report["caught"] == [], report["caught"]
    assert report["releaser_alive"], "the background releaser thread died"
