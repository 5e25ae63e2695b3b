"""ReplicatedModule in a healthy world: built once and copied, calls spread over the replicas,
state checked equal, inference only. (Lost and frozen replicas: test_failover.py.)"""

import pytest
import torch
import torch.distributed.rpc as rpc

from remote_module import BatchPolicy
from remote_module.serving import ReplicatedModule
from tests.proxy import _batching_remote as host

pytestmark = pytest.mark.usefixtures("rpc_world")

REPLICAS = ["worker1/cpu", "worker2/cpu"]


def test_replicas_are_one_state_copied_not_seeded_alike():
    from remote_module import RemoteModule

    # each worker draws a Linear's weights from its own RNG: built apart, they differ
    apart = [RemoteModule(w, torch.nn.Linear, (8, 4)).state_dict()["weight"] for w in REPLICAS]
    assert not torch.equal(apart[0], apart[1])
    model = ReplicatedModule(REPLICAS, torch.nn.Linear, (8, 4)).eval()
    state = model.state_dict()  # (checked equal on both replicas: copied from the first)
    local = torch.nn.Linear(8, 4)
    local.load_state_dict(state)
    x = torch.randn(4, 8)
    with torch.no_grad():
        outs = [model(x) for _ in range(4)]
        assert all(torch.equal(o, local(x)) for o in outs)
        other = torch.nn.Linear(8, 4).state_dict()
        model.load_state_dict(other)
        local.load_state_dict(other)
        assert all(torch.equal(model(x), local(x)) for _ in range(4))
    assert all(torch.equal(v, other[k]) for k, v in model.state_dict().items())


def test_calls_spread_over_the_replicas():
    model = ReplicatedModule(REPLICAS, host.RecordingMLP, (9,)).eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        futs = [model.forward_async(x, name="replicas-spread") for _ in range(20)]
        outs = [f.wait() for f in futs]
    assert all(torch.equal(o, outs[0]) for o in outs)
    counts = [len(rpc.rpc_sync(w.split("/")[0], host.sizes, ("replicas-spread",))) for w in REPLICAS]
    assert sum(counts) == 20 and min(counts) > 0, counts


def test_a_call_that_records_gradients_is_refused_and_sends_nothing():
    model = ReplicatedModule(REPLICAS, host.RecordingMLP, (10,))
    with pytest.raises(RuntimeError, match="serves inference"):
        model(torch.randn(1, 8), name="replicas-refused")
    assert [rpc.rpc_sync(w.split("/")[0], host.sizes, ("replicas-refused",)) for w in REPLICAS] == [[], []]


def test_errors_of_the_module_and_of_the_arguments():
    model = ReplicatedModule(REPLICAS, host.RecordingMLP, (11,)).eval()
    with torch.no_grad():
        with pytest.raises(ValueError, match="NaN"):  # raised once, not tried on every replica
            model(torch.full((1, 8), float("nan")), name="replicas-nan")
        with pytest.raises(TypeError):
            model(torch.randn(1, 8), no_such_argument=1)
    assert sum(len(rpc.rpc_sync(w.split("/")[0], host.sizes, ("replicas-nan",))) for w in REPLICAS) == 0


def test_bad_construction_arguments():
    with pytest.raises(ValueError, match="different workers"):
        ReplicatedModule(["worker1/cpu", "worker1/cpu"], host.RecordingMLP)
    with pytest.raises(ValueError, match="non-empty"):
        ReplicatedModule([], host.RecordingMLP)
    with pytest.raises(ValueError, match="hedge_ms"):
        ReplicatedModule(REPLICAS, host.RecordingMLP, hedge_ms=0)


def test_replicas_batch_when_asked():
    model = ReplicatedModule(REPLICAS, host.RecordingMLP, (12,), batching=BatchPolicy(max_wait_ms=1)).eval()
    local = host.RecordingMLP(12).eval()
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(model(x), local(x))
    assert all(s["state"] == "live" for s in model.replica_states())


def test_it_travels_over_rpc_as_the_same_replicas():
    import copy
    import pickle

    model = ReplicatedModule(REPLICAS, host.RecordingMLP, (13,)).eval()
    local = host.RecordingMLP(13).eval()
    x = torch.randn(3, 8)
    out = rpc.rpc_sync("bare", host.no_grad_forward, (model, x, "replicas-travel"))  # served from "bare"
    with torch.no_grad():
        assert torch.equal(out, local(x))
    # (once, or twice when the first call from "bare", which opens its connections, outlasts hedge_ms)
    assert sum(len(rpc.rpc_sync(w.split("/")[0], host.sizes, ("replicas-travel",))) for w in REPLICAS) in (1, 2)
    with pytest.raises(TypeError, match="state_dict"):
        pickle.dumps(model)
    with pytest.raises(TypeError, match="state_dict"):
        copy.deepcopy(model)


def test_serving_in_training_mode_warns_once():
    import warnings

    model = ReplicatedModule(REPLICAS, host.RecordingMLP, (14,))
    with torch.no_grad():
        with pytest.warns(UserWarning, match=r"training mode.*\.eval\(\)"):
            model(torch.randn(1, 8), name="replicas-train")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model(torch.randn(1, 8), name="replicas-train")


def test_casts_reach_every_replica():
    model = ReplicatedModule(REPLICAS, torch.nn.Linear, (8, 4)).eval()
    local = torch.nn.Linear(8, 4)
    local.load_state_dict(model.state_dict())
    model.double()
    local.double()
    x = torch.randn(3, 8, dtype=torch.float64)
    with torch.no_grad():
        outs = [model(x) for _ in range(4)]  # (spread over both replicas)
    assert all(o.dtype == torch.float64 and torch.equal(o, local(x)) for o in outs)
    assert all(v.dtype == torch.float64 for v in model.state_dict().values())
