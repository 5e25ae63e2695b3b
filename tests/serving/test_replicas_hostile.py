"""ReplicatedModule used as a hostile user would, in the shared healthy world (worker1, worker2):
blocking callbacks, nesting in a parent module, bad arguments, tiny hedge delays, timeouts."""

import copy
import pickle
import threading
import time

import pytest
import torch
import torch.distributed.rpc as rpc
from torch import nn

from remote_module import BatchPolicy, RemoteModule
from remote_module._core import CallTimeout, schedule
from remote_module.serving import ReplicatedModule
from tests._deadlines import HANG_S
from tests._faults import gates
from tests.proxy import _batching_remote as host

pytestmark = pytest.mark.usefixtures("rpc_world")

REPLICAS = ["worker1/cpu", "worker2/cpu"]


def _release(key):
    for w in REPLICAS:
        rpc.rpc_sync(w.split("/")[0], gates.release, (key,))


def test_a_blocking_callback_on_a_timed_out_call_does_not_stall_the_deadline_watcher(monkeypatch):
    """The call's deadline is the watcher's (the RPC's own timeout is made later here, as a slow
    agent's would be): the user's callback must not run on the process-wide watcher thread."""
    model = ReplicatedModule(["worker1/cpu"], host.RecordingMLP, (20,), timeout=60, hedge_ms=60_000).eval()
    model.timeout_s = 0.5  # (calls only: creating may take longer on a loaded machine)
    attempt = RemoteModule._attempt
    monkeypatch.setattr(RemoteModule, "_attempt", lambda self, a, k, t: attempt(self, a, k, t + 60))
    entered, unblock, fired = threading.Event(), threading.Event(), threading.Event()
    where = []

    def blocking(fut):
        where.append(threading.current_thread().name)
        entered.set()
        unblock.wait(HANG_S)

    class Target:
        def expire(self, now):
            fired.set()

    target = Target()
    try:
        with torch.no_grad():
            fut = model.forward_async(torch.randn(1, 8), gate="hostile-cb")
        fut.add_done_callback(blocking)
        assert entered.wait(HANG_S), "the call never timed out"
        with pytest.raises(CallTimeout):
            fut.wait()
        schedule(time.monotonic() + 0.05, target)  # any other deadline in this process
        assert fired.wait(60), f"deadline watcher stalled by a user callback (ran on {where})"
    finally:
        unblock.set()
        _release("hostile-cb")


def test_nested_in_a_parent_module_load_state_dict_honours_strict_and_reports_keys():
    parent = nn.Module()
    parent.rep = ReplicatedModule(REPLICAS, nn.Linear, (8, 4))
    sd = parent.state_dict()
    assert sorted(sd) == ["rep.bias", "rep.weight"]
    parent.eval()
    assert not parent.rep.training
    new = nn.Linear(8, 4).state_dict()
    parent.load_state_dict({"rep.weight": new["weight"], "rep.bias": new["bias"]})
    assert torch.equal(parent.state_dict()["rep.weight"], new["weight"])
    # strict=True and a key missing: torch's RuntimeError naming it (not a silent success)
    with pytest.raises(RuntimeError, match="bias"):
        parent.load_state_dict({"rep.weight": new["weight"]})
    parent.rep.state_dict()  # (raises if the failed load left the replicas different)
    # strict=False: loaded what is there, the rest reported
    w = torch.randn(4, 8)
    result = parent.load_state_dict({"rep.weight": w, "rep.bogus": torch.zeros(1)}, strict=False)
    assert "rep.bias" in result.missing_keys and "rep.bogus" in result.unexpected_keys, result
    assert torch.equal(parent.state_dict()["rep.weight"], w)


class GradFlag(nn.Module):
    """(On a host) answers whether its forward ran with grad enabled; held on ``gate``."""

    def forward(self, x, gate=None):
        if gate is not None:
            gates.hold(gate)
        return torch.tensor(torch.is_grad_enabled())


def test_hedged_and_resent_calls_run_without_grad_on_the_host():
    """A call is made under no_grad; its hedge is sent from the watcher thread, where grad is
    on by default: the host must still run it without grad (no graph, no warning)."""
    model = ReplicatedModule(REPLICAS, GradFlag, timeout=60, hedge_ms=50).eval()
    rpc.rpc_sync("worker2", gates.release, ("hostile-grad",))  # worker2 never holds it
    try:
        with torch.no_grad():
            futs = [model.forward_async(torch.ones(1), gate="hostile-grad") for _ in range(4)]
            flags = [bool(f.wait()) for f in futs]  # worker1's are answered by worker2, hedged
        assert flags == [False] * 4, flags
    finally:
        _release("hostile-grad")


def test_held_calls_time_out_with_CallTimeout_and_the_replicas_stay_usable():
    model = ReplicatedModule(REPLICAS, host.RecordingMLP, (21,), timeout=60, hedge_ms=100).eval()
    model.timeout_s = 0.5  # (calls only: creating may take longer on a loaded machine)
    x = torch.randn(1, 8)
    try:
        with torch.no_grad():
            start = time.monotonic()
            futs = [model.forward_async(x, gate="hostile-held") for _ in range(3)]
            for f in futs:
                with pytest.raises(CallTimeout):
                    f.wait()
            assert time.monotonic() - start >= 0.5
    finally:
        _release("hostile-held")
    deadline = time.monotonic() + HANG_S
    while any(s["state"] != "live" for s in model.replica_states()):
        assert time.monotonic() < deadline, model.replica_states()
        time.sleep(0.05)
    with torch.no_grad():
        assert torch.equal(model(x), host.RecordingMLP(21).eval()(x))


def test_a_tiny_hedge_under_load_keeps_every_answer_right():
    model = ReplicatedModule(REPLICAS, host.RecordingMLP, (22,), hedge_ms=1).eval()
    local = host.RecordingMLP(22).eval()
    xs = [torch.randn(2, 8) for _ in range(100)]
    with torch.no_grad():
        futs = [model.forward_async(x) for x in xs]
        outs = [f.wait() for f in futs]
        assert all(torch.equal(o, local(x)) for o, x in zip(outs, xs))
    deadline = time.monotonic() + HANG_S
    while any(s["outstanding"] for s in model.replica_states()):
        assert time.monotonic() < deadline, model.replica_states()
        time.sleep(0.05)
    assert all(s["state"] != "lost" for s in model.replica_states())


def test_unpicklable_or_wrong_arguments_and_module_errors_leave_replicas_clean():
    model = ReplicatedModule(REPLICAS, host.RecordingMLP, (23,)).eval()
    with torch.no_grad():
        with pytest.raises(Exception):
            model(torch.randn(1, 8), name=threading.Lock())
        with pytest.raises(TypeError):
            model()
        for _ in range(4):
            with pytest.raises(ValueError, match="NaN"):
                model(torch.full((1, 8), float("nan")))
        assert model(torch.randn(1, 8)).shape == (1, 4)
    assert [(s["state"], s["outstanding"]) for s in model.replica_states()] == [("live", 0)] * 2


def test_default_timeout_is_the_agents():
    model = ReplicatedModule(REPLICAS, host.RecordingMLP, (24,))
    assert model.timeout_s == rpc.get_rpc_timeout()


def test_load_state_dict_with_bad_keys_leaves_replicas_equal():
    model = ReplicatedModule(REPLICAS, nn.Linear, (8, 4))
    good = model.state_dict()
    with pytest.raises(Exception):
        model.load_state_dict({"weight": torch.zeros(4, 8)})  # strict: bias missing
    with pytest.raises(Exception):
        model.load_state_dict({"weight": torch.zeros(3, 3), "bias": torch.zeros(4)}, strict=False)
    model.state_dict()  # (raises if the replicas differ)
    result = model.load_state_dict({**good, "extra": torch.zeros(1)}, strict=False)
    assert list(result.unexpected_keys) == ["extra"]


def test_copying_or_pickling_fails_clearly_or_works():
    model = ReplicatedModule(REPLICAS, nn.Linear, (8, 4)).eval()
    for how in (copy.deepcopy, pickle.dumps):
        try:
            how(model)
        except Exception as exc:  # noqa: BLE001
            assert "ReplicatedModule" in str(exc), f"{how.__name__}: unclear error {type(exc).__name__}: {exc}"


@pytest.mark.slow
def test_kills_and_freezes():
    from tests._deadlines import SETUP_S
    from tests._faults import replica_hostile_world as world
    from tests._faults.subworld import run_report

    report = run_report("tests._faults.replica_hostile_world", list(world.ROLES), timeout=SETUP_S + 2 * HANG_S)
    print(report["unnoticed"], report["frozen"], report["killed_frozen"])
    # a replica killed and not yet noticed by a call: state and modes still served by the others
    assert report["unnoticed"]["state_dict"]["ok"], report["unnoticed"]
    assert report["unnoticed"]["eval"]["ok"], report["unnoticed"]
    # two replicas killed mid-burst of 200: none fails
    bad = [c for c in report["burst"]["calls"] if not c["ok"]]
    assert not bad, bad[:3]
    # the only live replica frozen: each call fails with CallTimeout, not before its timeout
    for c in report["frozen"]["calls"]:
        assert c["type"] == "CallTimeout" and c["seconds"] >= world.TIMEOUT, c
    # the frozen one killed: calls in flight fail (no hang), then a clear error at once
    assert all(c["type"] in ("RuntimeError", "CallTimeout") for c in report["killed_frozen"]["calls"]), report
    after = report["killed_frozen"]["after"]
    assert after["type"] == "RuntimeError" and "no live replica" in after["message"], after
    # rpc.shutdown(graceful=False) with calls in flight to a frozen replica, probes running
    down = report["shutdown"]
    print(down)
    assert down["returned"], down
    assert all(c["type"] != "HANG" and not c["ok"] for c in down["calls"]), down["calls"]
    assert "Traceback" not in down["stderr"] and "Exception" not in down["stderr"], down["stderr"]


def test_an_input_reused_after_the_call_is_sent_does_not_change_its_answer():
    """A serving loop refills its input buffer once ``forward_async`` returned (a RemoteModule
    pickles at once, so that is safe there): a hedged or resent call must still carry the
    input as it was when the call was made."""
    model = ReplicatedModule(REPLICAS, host.RecordingMLP, (25,), timeout=60, hedge_ms=50).eval()
    local = host.RecordingMLP(25).eval()
    rpc.rpc_sync("worker2", gates.release, ("hostile-reuse",))  # worker2 never holds it
    buf = torch.empty(1, 8)
    try:
        with torch.no_grad():
            wants, futs = [], []
            for i in range(4):
                buf.copy_(torch.full((1, 8), float(i + 1)))
                wants.append(local(buf))
                futs.append(model.forward_async(buf, gate="hostile-reuse"))
                buf.fill_(float("nan"))  # (the loop reuses the buffer)
            outs = [f.wait() for f in futs]  # worker1's are hedged to worker2
        assert all(torch.equal(o, w) for o, w in zip(outs, wants)), outs
    finally:
        _release("hostile-reuse")


def test_a_tiny_hedge_with_batching_and_assign():
    model = ReplicatedModule(REPLICAS, host.RecordingMLP, (27,), hedge_ms=1,
                             batching=BatchPolicy(max_wait_ms=5)).eval()
    local = host.RecordingMLP(27).eval()
    xs = [torch.randn(1, 8) for _ in range(60)]
    with torch.no_grad():
        futs = [model.forward_async(x) for x in xs]
        diffs = [float((f.wait() - local(x)).abs().max()) for f, x in zip(futs, xs)]
        assert max(diffs) < 1e-5, diffs  # (joined batches may round differently in the last bits)
    other = host.RecordingMLP(28).state_dict()
    model.load_state_dict(other, assign=True)
    assert all(torch.equal(v, other[k]) for k, v in model.state_dict().items())


def test_deleting_the_module_with_calls_in_flight():
    model = ReplicatedModule(REPLICAS, host.RecordingMLP, (26,)).eval()
    x = torch.randn(2, 8)
    want = host.RecordingMLP(26).eval()(x)
    with torch.no_grad():
        futs = [model.forward_async(x) for _ in range(50)]
    del model
    import gc

    gc.collect()
    assert all(torch.equal(f.wait(), want) for f in futs)
