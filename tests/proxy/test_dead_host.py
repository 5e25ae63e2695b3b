"""A host that dies: the next calls fail within the proxy's timeout, naming the dead worker,
and proxies on live workers keep working. Its own world (it kills a worker)."""

from remote_module._core.settling import WATCH_TICK_S
from tests._deadlines import HANG_S, SETUP_S
from tests._faults import dead_host
from tests._faults.subworld import run_report


def test_dead_host_fails_fast_and_others_keep_working():
    report = run_report("tests._faults.dead_host", list(dead_host.ROLES), timeout=SETUP_S + HANG_S)
    timeout = report["timeout"]
    assert report["before"]["ok"]
    for key in ("sync", "async"):
        failure = report[key]
        assert not failure["ok"], failure
        assert "doomed" in failure["message"], failure
        # the host stays dead: what ended the call is the library noticing the death, or at the
        # latest the call's own timeout (never before it)
        if failure["type"] == "CallTimeout":
            assert failure["seconds"] >= timeout - WATCH_TICK_S, failure
        assert failure["seconds"] < timeout + HANG_S, f"hang guard: {failure}"
    assert report["survivor"]["ok"] and report["survivor_async"]["ok"]
    after = report["after_shutdown"]
    assert not after["ok"] and after["type"] == "RuntimeError"
    assert "call rpc.init_rpc" in after["message"], after
    # a proxy on the agent's default timeout says the same (not torch's "agent is not set")
    for after in report["after_shutdown_agent_default"]:
        assert not after["ok"] and after["type"] == "RuntimeError", after
        assert "call rpc.init_rpc" in after["message"], after
