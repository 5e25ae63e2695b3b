"""A host that dies: the next calls fail within the proxy's timeout, naming the dead worker,
and proxies on live workers keep working. Its own world (it kills a worker)."""

from tests._faults import dead_host
from tests._faults.subworld import run_report


def test_dead_host_fails_fast_and_others_keep_working():
    report = run_report("tests._faults.dead_host", list(dead_host.ROLES), timeout=90)
    limit = report["timeout"] + 3.0
    assert report["before"]["ok"]
    for key in ("sync", "async"):
        failure = report[key]
        assert not failure["ok"], failure
        assert failure["seconds"] < limit, failure
        assert "doomed" in failure["message"], failure
    assert report["survivor"]["ok"] and report["survivor_async"]["ok"]
    after = report["after_shutdown"]
    assert not after["ok"] and after["type"] == "RuntimeError"
    assert "call rpc.init_rpc" in after["message"], after
    # a proxy on the agent's default timeout says the same (not torch's "agent is not set")
    for after in report["after_shutdown_agent_default"]:
        assert not after["ok"] and after["type"] == "RuntimeError", after
        assert "call rpc.init_rpc" in after["message"], after
