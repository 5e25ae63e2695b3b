"""The calls contract (README, "Calls") under faults, each in a small world of its own
subprocesses: a frozen host (SIGSTOP), callbacks that block while a frozen host's calls time
out, a host killed mid-burst (SIGKILL), calls outstanding when the caller leaves gracefully
(``rpc.shutdown()``, ``Worker`` exit, the end of a ``run_local`` function), and ``SystemExit``
in a module's constructor. The worlds run the scenarios and report what they measured
(tests/_faults/frozen_host.py, tests/_faults/shutdown_calls.py); the tests here judge it.
(The contract on the shared world: tests/proxy/test_contract_calls.py.)"""

from __future__ import annotations

import json

import pytest

from rpc_backend import run_local
from tests._deadlines import HANG_S, SETUP_S
from tests._faults import frozen_host as fh
from tests._faults import shutdown_calls as sc
from tests._faults.subworld import run_report

pytestmark = pytest.mark.slow

#: the watcher may fail a call up to one tick (50 ms) before a message's own RPC timeout would
EARLY = 0.06
#: a world's start and its scenario, whose every wait is guarded by HANG_S
WORLD_S = SETUP_S + HANG_S


@pytest.fixture(scope="module")
def frozen():
    """One world for the frozen, blocked-callback and killed-host phases (they run in turn)."""
    return run_report("tests._faults.frozen_host", list(fh.ROLES), timeout=WORLD_S)


@pytest.fixture(scope="module")
def shutdown_burst():
    return run_report("tests._faults.shutdown_calls", list(sc.ROLES), timeout=WORLD_S, args=("burst",))


def phase(report: dict, name: str) -> dict:
    result = report[name]
    assert "error" not in result, f"phase {name!r} failed in the world:\n{result['error']}"
    return result


def assert_all_failed_at_their_deadline(report: dict, timeout: float) -> None:
    """Every call of the burst failed with its own timeout's error, never before its deadline,
    while the host was still frozen (it is thawed only once every outcome is in, so no answer
    of its ended a call); the only upper bound is the hang guard."""
    burst = report["burst"]
    assert report["still_frozen"], "the host was running again before every call of the burst had failed"
    assert burst["calls"] == fh.BURST and burst["unsettled"] == 0, burst
    assert burst["ok"] == 0 and burst["failure_types"] == ["CallTimeout"], burst
    assert burst["earliest"] >= timeout - EARLY, f"a call failed before its deadline: {burst}"
    assert burst["latest"] < timeout + HANG_S, f"hang guard: a call failed {burst['latest']:.2f} s after it was made"
    assert burst["callback_counts"] == [1], f"a future settled twice or never: {burst}"


# ---- a frozen host -----------------------------------------------------------------------------


def test_frozen_host_every_call_fails_at_its_own_deadline_saying_whether_it_was_sent(frozen):
    report = phase(frozen, "frozen")
    burst = report["burst"]
    assert_all_failed_at_their_deadline(report, frozen["frozen_timeout"])
    # queued calls say they were never sent; those in the messages in flight say where they went
    assert burst["unsent"] > 0 and burst["sent"] > 0 and burst["unsent"] + burst["sent"] == burst["calls"], burst
    blocking = report["blocking"]  # a blocking forward made behind the burst, with its own timeout
    assert not blocking["ok"] and blocking["type"] == "CallTimeout", blocking
    assert blocking["seconds"] >= frozen["blocking_timeout"] - EARLY, f"failed before its deadline: {blocking}"
    assert blocking["seconds"] < frozen["blocking_timeout"] + HANG_S, f"hang guard: {blocking}"
    assert "no answer within 3 s" in blocking["message"] or "before it was sent" in blocking["message"], blocking


def test_frozen_host_thawed_works_again_and_late_answers_settle_nothing(frozen):
    report = phase(frozen, "frozen")
    assert report["works_again"], "after SIGCONT the proxy's answers differ from a local copy of the module"
    assert report["callback_counts_after_thaw"] == [1], "a late answer settled a future a second time"
    assert report["errors_logged"] == [], report["errors_logged"]  # e.g. a future settled twice
    assert report["callbacks_that_raised"] == 0


def test_callbacks_that_block_do_not_delay_other_calls_deadlines(frozen):
    # callbacks on the earliest futures block forever, or wait on another call of the same
    # proxy (forward_async(...).wait() and a blocking forward) while the host is frozen
    report = phase(frozen, "blocking_callbacks")
    assert_all_failed_at_their_deadline(report, frozen["frozen_timeout"])
    # every other call failed (and the host was thawed and used again) while those blocked
    assert report["blockers_returned"] == 0, "a callback that blocks forever returned before it was let go"
    assert len(report["inner"]) == 3, f"a callback calling the same proxy never returned: {report['inner']}"
    assert report["works_again"]
    assert report["errors_logged"] == [], report["errors_logged"]
    assert report["callbacks_that_raised"] == 0


# ---- a killed host -----------------------------------------------------------------------------


def test_killed_host_fails_every_outstanding_call_promptly_naming_it(frozen):
    report = phase(frozen, "killed")
    # a dead peer is noticed at once, not at the deadline: every failure is the death's own
    # error, never the calls' timeout (KILLED_TIMEOUT, a hang guard), whatever the speed
    timeout = frozen["killed_timeout"]
    assert report["outstanding_at_kill"] > 0
    for name in ("burst", "after_death"):
        calls = report[name]
        assert calls["unsettled"] == 0, calls
        assert calls["ok"] + calls["naming_victim"] == calls["calls"], f"a failure does not name the worker: {calls}"
        assert "CallTimeout" not in calls["failure_types"], f"a call to the dead host failed at its deadline: {calls}"
        assert calls["latest"] < timeout, f"hang guard: a call to the dead host took {calls['latest']:.2f} s to fail"
        assert calls["callback_counts"] == [1], calls
    assert report["burst"]["ok"] > 0  # answers were arriving when the host died
    assert report["after_death"]["ok"] == 0
    blocking = report["blocking"]
    assert not blocking["ok"] and "'victim'" in blocking["message"], blocking
    assert blocking["type"] != "CallTimeout" and blocking["seconds"] < timeout, blocking
    assert report["survivor_works"], "calls to the surviving host differ from a local copy of its module"


# ---- calls outstanding at a graceful shutdown ------------------------------------------------


def assert_all_answered(calls: dict, count: int) -> None:
    assert calls["outstanding_at_shutdown"] > 0, f"nothing was outstanding when the caller left: {calls}"
    assert calls["unsettled"] == 0 and calls["failures"] == 0 and calls["wrong"] == 0, calls
    assert calls["ok"] == count, calls


def test_rpc_shutdown_answers_every_call_made_before_it(shutdown_burst):
    assert shutdown_burst["shutdown"]["completed"] and shutdown_burst["shutdown"]["error"] is None, shutdown_burst
    cheap = shutdown_burst["cheap"]
    assert cheap["shared_messages"] > 0  # calls were still queued to share messages
    assert_all_answered(cheap, sc.CHEAP_CALLS)


def test_rpc_shutdown_mid_burst_answers_slow_calls_made_from_several_threads(shutdown_burst):
    assert shutdown_burst["shutdown"]["completed"], shutdown_burst
    assert_all_answered(shutdown_burst["slow"], sc.SLOW_THREADS * sc.SLOW_CALLS_PER_THREAD)


def test_leaving_through_worker_exit_answers_every_call_made_before_it():
    report, host = run_local(sc.leave_through_worker, 2, timeout=WORLD_S, rpc_timeout=SETUP_S)
    assert host is None
    assert report["shared_messages"] > 0
    assert_all_answered(report, sc.CHEAP_CALLS)


def test_the_end_of_a_run_local_function_answers_every_call_made_before_it(tmp_path):
    path = tmp_path / "report.json"
    run_local(sc.leave_at_function_end, 2, args=(str(path),), timeout=WORLD_S, rpc_timeout=SETUP_S)
    report = json.loads(path.read_text())
    assert report["shared_messages"] > 0
    assert_all_answered(report, sc.CHEAP_CALLS)


# ---- SystemExit in a module constructor ------------------------------------------------------


def test_system_exit_in_a_constructor_raises_at_once_and_shutdown_completes():
    report = run_report("tests._faults.shutdown_calls", list(sc.ROLES), timeout=WORLD_S, args=("exit_in_init",))
    raised = report["constructor"]
    # at once: with the host's SystemExit, not the timeout's CallTimeout (a hang guard here)
    assert raised["raised"] == "SystemExit" and raised["is_exception"], raised  # never stops the caller
    assert "SystemExit: 4" in raised["message"], raised
    assert "on host " in raised["message"] or "'host'" in raised["message"], f"names no worker: {raised}"
    assert raised["seconds"] < raised["timeout"], f"hang guard: the constructor waited {raised['seconds']:.1f} s"
    assert report["host_still_works"]
    assert report["shutdown"]["completed"] and report["shutdown"]["error"] is None, report["shutdown"]
