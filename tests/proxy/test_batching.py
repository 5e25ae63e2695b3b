"""Host-side batching (remote_module.BatchPolicy): concurrent no-grad calls to one hosted
module joined into one forward, each call keeping its own result, error and timeout.

How a batch is made here without sleeping: the policy's ``max_wait_ms`` is 0, and a first call
is held on a gate inside ``forward`` (it runs alone, holding the host's batcher); the calls
made meanwhile queue (the test polls the host until they have), and once the gate opens they
run as one forward."""


import pytest
import torch
import torch.distributed.rpc as rpc

from remote_module import BatchPolicy, CallTimeout, RemoteModule
from tests._faults import gates
from tests.proxy import _batching_remote as host

pytestmark = pytest.mark.usefixtures("rpc_world")

POLICY = BatchPolicy(dim=0, max_batch=64, max_wait_ms=0)


_wait_queued = host.wait_queued
_held_first = host.held_first


def test_policy_checks_its_fields():
    with pytest.raises(ValueError, match="max_batch"):
        BatchPolicy(max_batch=0)
    with pytest.raises(ValueError, match="max_wait_ms"):
        BatchPolicy(max_wait_ms=float("nan"))
    with pytest.raises(TypeError, match="dim"):
        BatchPolicy(dim=0.5)
    with pytest.raises(TypeError, match="BatchPolicy"):
        RemoteModule("worker1/cpu", host.RecordingMLP, batching={"max_batch": 4}).eval()


def test_concurrent_calls_run_as_one_forward_equal_to_the_joined_local_batch():
    proxy = RemoteModule("worker1/cpu", host.RecordingMLP, (1,), batching=POLICY).eval()
    assert proxy.batching == POLICY
    local = host.RecordingMLP(1)
    first = _held_first(proxy, "bt-join")
    xs = [torch.randn(k, 8) for k in (1, 3, 2)]
    with torch.no_grad():
        futs = [proxy.forward_async(x, name="join") for x in xs]
        # a caller on another worker, with the proxy it received, joins too
        other = rpc.rpc_async("worker2", host.no_grad_forward, (proxy, torch.randn(2, 8), "join"))
    _wait_queued(4)
    rpc.rpc_sync("worker1", gates.release, ("bt-join",))
    outs = [f.wait() for f in futs]
    other_out = other.wait()
    first.wait()
    # one forward of all four, then the first call to arrive alone (the check of the first joined
    # batch of its kind)
    sizes = rpc.rpc_sync("worker1", host.sizes, ("join",))
    assert sizes[0] == 8 and len(sizes) == 2 and sizes[1] in (1, 2, 3), sizes
    with torch.no_grad():
        joined = local(torch.cat(xs + [torch.zeros(0, 8)]))
        at = 0
        for x, out in zip(xs, outs):
            assert torch.equal(out, joined[at:at + x.shape[0]])  # bit for bit: the same batch
            assert torch.allclose(out, local(x), rtol=1e-5, atol=1e-6)  # its own batch: within float tolerance
            at += x.shape[0]
    assert other_out.shape == (2, 4)


def test_a_bad_input_fails_alone_and_its_neighbours_get_their_results():
    proxy = RemoteModule("worker1/cpu", host.RecordingMLP, (2,), batching=POLICY).eval()
    local = host.RecordingMLP(2)
    first = _held_first(proxy, "bt-bad")
    bad = torch.randn(2, 8)
    bad[1, 3] = float("nan")
    xs = [torch.randn(1, 8), bad, torch.randn(3, 8)]
    with torch.no_grad():
        futs = [proxy.forward_async(x, name="bad") for x in xs]
    _wait_queued(3)
    rpc.rpc_sync("worker1", gates.release, ("bt-bad",))
    first.wait()
    with torch.no_grad():
        assert torch.allclose(futs[0].wait(), local(xs[0]), rtol=1e-5, atol=1e-6)
        assert torch.allclose(futs[2].wait(), local(xs[2]), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="a row with NaN"):
        futs[1].wait()


def test_calls_that_differ_outside_the_batch_dimension_are_not_joined():
    proxy = RemoteModule("worker1/cpu", host.RecordingMLP, (3,), batching=POLICY).eval()
    first = _held_first(proxy, "bt-shape")
    with torch.no_grad():
        a = proxy.forward_async(torch.randn(2, 8), name="shape")
        b = proxy.forward_async(torch.randn(2, 5), name="shape")  # fails on its own: 5 features
        c = proxy.forward_async(torch.randn(1, 8), name="shape")
    _wait_queued(3)
    rpc.rpc_sync("worker1", gates.release, ("bt-shape",))
    first.wait()
    assert a.wait().shape == (2, 4) and c.wait().shape == (1, 4)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        b.wait()
    # a and c ran as one forward of 3 (and the first of them to arrive alone, the first batch's
    # check); b ran alone (and failed in its Linear)
    assert sorted(rpc.rpc_sync("worker1", host.sizes, ("shape",))) in ([2, 2, 3], [1, 2, 3])


def test_calls_with_grad_on_are_not_queued():
    proxy = RemoteModule("worker1/cpu", host.RecordingMLP, (4,), batching=POLICY).eval()
    # (a second proxy: a blocking call waits for the same proxy's earlier calls, program order)
    second = RemoteModule.init_from_module_rref("worker1/cpu", proxy.module_rref)
    first = _held_first(proxy, "bt-grad")
    try:
        x = torch.randn(2, 8)
        with pytest.warns(UserWarning):  # (a forward that records outside dist autograd warns)
            out = second(x, name="grad")  # runs now, beside the held batch
        assert out.shape == (2, 4)
        assert rpc.rpc_sync("worker1", host.queued) == 0
    finally:
        rpc.rpc_sync("worker1", gates.release, ("bt-grad",))
    first.wait()


def test_a_queued_call_keeps_its_own_timeout():
    proxy = RemoteModule("worker1/cpu", host.RecordingMLP, (5,), batching=POLICY).eval()
    short = RemoteModule.init_from_module_rref("worker1/cpu", proxy.module_rref, timeout=0.5)
    assert short.batching == POLICY  # learnt from the host
    first = _held_first(proxy, "bt-timeout")
    try:
        with torch.no_grad():
            late = short.forward_async(torch.randn(1, 8), name="timeout")
            patient = proxy.forward_async(torch.randn(1, 8), name="timeout")
        with pytest.raises(CallTimeout):
            late.wait()
    finally:
        rpc.rpc_sync("worker1", gates.release, ("bt-timeout",))
    first.wait()
    assert patient.wait().shape == (1, 4)


def test_a_lone_call_is_the_plain_call():
    proxy = RemoteModule("worker1/cpu", host.RecordingMLP, (6,), batching=BatchPolicy(max_wait_ms=1)).eval()
    local = host.RecordingMLP(6)
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(proxy(x), local(x))
        with pytest.raises(ValueError, match="NaN"):
            proxy(torch.full((1, 8), float("nan")))


@pytest.mark.parametrize("module, dim, shapes", [
    (host.Flattened, 1, [(5, 1), (5, 1)]),  # the output's size along dim 1 is the batch's by chance
    (host.Mixing, 0, [(2, 3), (1, 3)]),  # the rows are not independent along dim 0
])
def test_a_first_joined_batch_that_a_call_alone_contradicts_is_not_joined(module, dim, shapes):
    # the first joined batch of a kind also runs its first call alone: when the call alone
    # gets another output than its part of the joined one, each call gets its own result, and
    # such calls run alone from then on
    name = f"contradicted-{module.__name__}"
    proxy = RemoteModule("worker1/cpu", module, batching=BatchPolicy(dim=dim, max_wait_ms=0)).eval()
    second = RemoteModule.init_from_module_rref("worker1/cpu", proxy.module_rref)
    for round_ in range(2):
        first = _held_first(proxy, f"bt-{name}-{round_}")
        xs = [torch.randn(*s) for s in shapes]
        with torch.no_grad():
            futs = [second.forward_async(x, name=name) for x in xs]
        if round_ == 0:
            _wait_queued(len(xs))
        rpc.rpc_sync("worker1", gates.release, (f"bt-{name}-{round_}",))
        first.wait()
        local = module()
        with torch.no_grad():
            for x, f in zip(xs, futs):
                assert torch.equal(f.wait(), local(x))
    sizes = rpc.rpc_sync("worker1", host.sizes, (name,))
    assert sizes.count(sum(s[dim] for s in shapes)) == 1, sizes  # joined once (the check), then never again


def test_batching_stats_say_what_the_host_did():
    proxy = RemoteModule("worker1/cpu", host.RecordingMLP, (15,), batching=POLICY)
    plain = RemoteModule("worker1/cpu", host.RecordingMLP, (15,))
    assert plain.batching_stats() is None
    x = torch.randn(1, 8)
    with torch.no_grad():
        with pytest.warns(UserWarning, match="eval mode"):
            proxy(x, name="stats")  # training mode: alone
        proxy.eval()
        first = _held_first(proxy, "bt-stats")
        futs = [proxy.forward_async(torch.randn(k, 8), name="stats") for k in (1, 2)]
        _wait_queued(2)
        rpc.rpc_sync("worker1", gates.release, ("bt-stats",))
        first.wait()
        [f.wait() for f in futs]
        proxy(torch.randn(1, 8), name="stats", gate=None)  # alone in the queue
    stats = proxy.batching_stats()
    assert stats["in_training_mode"] == 1
    assert stats["joined_forwards"] == 1 and stats["joined_calls"] == 2 and stats["checked_kinds"] == 1
    assert stats["alone_in_queue"] == 2  # the held call and the last one
    assert stats["refused_kinds"] == 0 and stats["run_again_alone"] == 0
