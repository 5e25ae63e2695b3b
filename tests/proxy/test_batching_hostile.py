"""Hostile-user tests of host-side batching (remote_module.BatchPolicy).

Batches are made as in tests/proxy/test_batching.py: max_wait_ms=0, a first call held on a
gate inside forward holds the host's batcher while the others queue."""

import copy

import pytest
import torch
import torch.distributed.rpc as rpc

from remote_module import BatchPolicy, RemoteModule
from remote_module._proxy import _host_calls
from tests._deadlines import HANG_S
from tests._faults import gates
from tests.proxy import _batching_hostile_remote as host
from tests.proxy import _batching_remote as base

pytestmark = pytest.mark.usefixtures("rpc_world")

POLICY = BatchPolicy(dim=0, max_batch=64, max_wait_ms=0)


_wait_queued = base.wait_queued


def _held_first(proxy, gate: str, shape=(1, 4)):
    return base.held_first(proxy, gate, shape)


def _joined(proxy, gate, calls, n_queued=None, shape=(1, 4)):
    """Run ``calls`` (a list of (args, kwargs)) while the batcher is held; their futures."""
    first = _held_first(proxy, gate, shape)
    try:
        with torch.no_grad():
            futs = [proxy.forward_async(*a, **k) for a, k in calls]
        _wait_queued(len(calls) if n_queued is None else n_queued)
    finally:
        rpc.rpc_sync("worker1", gates.release, (gate,))
    first.wait()
    return futs


def test_calls_of_one_message_keep_their_order_around_a_call_that_runs_alone():
    # A joinable, B cannot join (a bytes argument), C joinable: C must not run before B
    proxy = RemoteModule("worker1/cpu", host.Gated, batching=POLICY).eval()
    first = _held_first(proxy, "h-order")
    try:
        with torch.no_grad():
            calls = [proxy._make_call((torch.full((1, 4), float(v)),), {"name": "order", **extra}).wire()
                     for v, extra in ((1, {}), (2, {"blob": b"x"}), (3, {}))]
        answers = rpc.rpc_async("worker1", _host_calls._call_many_joining, (proxy._target().wire(), calls))
        _wait_queued(1)
    finally:
        rpc.rpc_sync("worker1", gates.release, ("h-order",))
    first.wait()
    answers.wait()
    ran = [v for batch in rpc.rpc_sync("worker1", host.log, ("order",)) for v in batch]
    assert ran == [1.0, 2.0, 3.0], f"forwards ran in the order {ran}"


def test_a_module_in_training_mode_never_joins_calls():
    # nn.Module's default is training mode: a BatchNorm then normalises by the batch's
    # statistics, so a joined call's output would depend on its neighbours' inputs. Calls of
    # a module in training mode run alone (each gets its own batch's statistics), and join
    # once it is in eval mode.
    proxy = RemoteModule("worker1/cpu", host.Norm, batching=POLICY)
    assert proxy.training
    xs = [torch.randn(3, 4), torch.randn(3, 4) * 10 + 5]
    with pytest.warns(UserWarning, match="batches calls only in eval mode"):  # (once per proxy)
        first = _held_first(proxy, "h-bn", shape=(2, 4))
    try:
        with torch.no_grad():
            futs = [proxy.forward_async(x, name="bn") for x in xs]
            outs = [f.wait() for f in futs]  # answered while the first call still holds its gate
        assert rpc.rpc_sync("worker1", base.queued) == 0
    finally:
        rpc.rpc_sync("worker1", gates.release, ("h-bn",))
    first.wait()
    local = torch.nn.BatchNorm1d(4)
    with torch.no_grad():
        for x, out in zip(xs, outs):
            assert torch.allclose(out, local(x), rtol=1e-4, atol=1e-5)


def test_one_unsplittable_output_does_not_turn_batching_off_for_good():
    proxy = RemoteModule("worker1/cpu", host.Stats, batching=POLICY).eval()
    xs = [torch.randn(1, 4), torch.randn(2, 4)]
    futs = _joined(proxy, "h-stats1", [((x,), {"name": "s1", "stats": True}) for x in xs])
    for x, f in zip(xs, futs):
        out, total = f.wait()
        assert torch.allclose(out, x * 2) and torch.allclose(total, x.sum())
    # the module's plain outputs split: later plain calls should still join
    assert rpc.rpc_sync("worker1", host.splits, (proxy.module_key,)), "batching was turned off for good"
    futs = _joined(proxy, "h-stats2", [((x,), {"name": "s2"}) for x in xs])
    for x, f in zip(xs, futs):
        assert torch.allclose(f.wait(), x * 2)
    ran = rpc.rpc_sync("worker1", host.log, ("s2",))  # one forward of both, then the first call to
    # arrive alone (the check of the first joined batch of its kind)
    assert len(ran) == 2 and sorted(ran[0]) == sorted(v for x in xs for v in x[:, 0].tolist()), ran
    assert ran[1] in [x[:, 0].tolist() for x in xs], ran


@pytest.mark.parametrize("kind", ["tuple_none", "dict", "scalar", "none", "rpc"])
def test_outputs_of_every_shape_come_back_per_call(kind):
    proxy = RemoteModule("worker1/cpu", host.Shapes, batching=POLICY).eval()
    xs = [torch.randn(1, 4), torch.randn(2, 4), torch.randn(0, 4)]
    futs = _joined(proxy, f"h-shape-{kind}", [((x,), {"name": kind, "kind": kind}) for x in xs])
    for x, f in zip(xs, futs):
        got = f.wait()
        if kind == "tuple_none":
            assert torch.equal(got[0], x + 1) and got[1] is None
        elif kind == "dict":
            assert torch.equal(got["a"], x + 1) and torch.equal(got["b"][0], x * 3)
        elif kind == "scalar":
            assert torch.allclose(got, x.sum())
        elif kind == "none":
            assert got is None
        else:
            assert torch.equal(got, x + 1)


def test_kwargs_only_dtypes_dim_minus_one_and_noncontiguous():
    proxy = RemoteModule("worker1/cpu", host.Gated, batching=BatchPolicy(dim=-1, max_batch=64, max_wait_ms=0)).eval()
    xs = [torch.randn(5, 2), torch.randn(5, 3).double(), torch.randn(3, 5).t(), torch.randn(5, 0)]
    futs = _joined(proxy, "h-dim", [((x,), {"name": "dim"}) for x in xs], n_queued=4)
    for x, f in zip(xs, futs):
        got = f.wait()
        assert got.dtype == x.dtype and torch.equal(got, x * 2)
    kw = RemoteModule("worker1/cpu", host.KwOnly, batching=POLICY).eval()
    with torch.no_grad():
        futs = [kw.forward_async(x=torch.ones(k, 2), y=torch.ones(k, 2)) for k in (1, 2)]
    assert [f.wait().shape for f in futs] == [(1, 2), (2, 2)]


def test_max_batch_is_a_limit_and_a_larger_call_runs_alone():
    proxy = RemoteModule("worker1/cpu", host.Gated, batching=BatchPolicy(max_batch=4, max_wait_ms=0)).eval()
    xs = [torch.randn(k, 4) for k in (2, 2, 5, 1, 2)]
    futs = _joined(proxy, "h-max", [((x,), {"name": "max"}) for x in xs], n_queued=4)
    for x, f in zip(xs, futs):
        assert torch.equal(f.wait(), x * 2)
    sizes = [len(b) for b in rpc.rpc_sync("worker1", host.log, ("max",))]
    # (12 rows, plus the first joined batch's first call again: its check)
    assert max(sizes) <= 5 and all(s <= 4 for s in sizes if s != 5) and sum(sizes) in (13, 14)


def test_requires_grad_and_inference_mode_inputs():
    proxy = RemoteModule("worker1/cpu", host.Gated, batching=POLICY).eval()
    x = torch.randn(2, 4, requires_grad=True)
    with torch.no_grad():
        assert torch.equal(proxy(x), x.detach() * 2)
    with torch.inference_mode():
        y = torch.randn(2, 4)
        assert torch.equal(proxy(y), y * 2)


def test_state_dict_train_eval_and_pickled_proxy_keep_batching():
    proxy = RemoteModule("worker1/cpu", host.Norm, batching=POLICY).eval()
    sd = proxy.state_dict()
    proxy.load_state_dict(sd)
    proxy.eval()
    assert not proxy.training
    proxy.train()
    assert proxy.training
    got = rpc.rpc_sync("worker2", base.no_grad_forward, (proxy, torch.randn(2, 4), "pickled"))
    assert got.shape == (2, 4)


def test_a_deep_copy_batches_as_its_proxy_says():
    proxy = RemoteModule("worker1/cpu", host.Gated, batching=POLICY).eval()
    assert rpc.rpc_sync("worker1", host.has_batcher, (proxy.module_key,))
    clone = copy.deepcopy(proxy)
    assert (clone.batching is not None) == rpc.rpc_sync("worker1", host.has_batcher, (clone.module_key,)), (
        f"the copy's proxy says batching={clone.batching!r}, its host module "
        f"{'has' if rpc.rpc_sync('worker1', host.has_batcher, (clone.module_key,)) else 'has no'} batcher")
    xs = [torch.randn(1, 4), torch.randn(2, 4)]
    futs = _joined(clone, "h-copy", [((x,), {"name": "copy"}) for x in xs])
    assert [f.wait().shape for f in futs] == [(1, 4), (2, 4)]
    # the copy joins too (then runs the first call alone: the first joined batch's check)
    ran = [len(b) for b in rpc.rpc_sync("worker1", host.log, ("copy",))]
    assert ran[0] == 3 and len(ran) == 2, ran


def test_queued_calls_of_a_deleted_proxy_are_answered():
    proxy = RemoteModule("worker1/cpu", host.Gated, batching=POLICY).eval()
    futs = None
    first = _held_first(proxy, "h-del")
    try:
        with torch.no_grad():
            futs = [proxy.forward_async(torch.randn(1, 4), name="del") for _ in range(3)]
        _wait_queued(3)
        del proxy
    finally:
        rpc.rpc_sync("worker1", gates.release, ("h-del",))
    first.wait()
    for f in futs:
        assert f.wait().shape == (1, 4)


def test_a_host_that_turns_warnings_into_errors_keeps_answering():
    # the batcher's RuntimeWarning about an output that does not split is raised on a host run
    # with -W error: the batcher thread must not die with calls queued
    proxy = RemoteModule("worker1/cpu", host.Stats, batching=POLICY, timeout=20).eval()
    rpc.rpc_sync("worker1", host.warnings_as_errors, (True,))
    try:
        xs = [torch.randn(1, 4), torch.randn(2, 4)]
        futs = _joined(proxy, "h-werror", [((x,), {"name": "werror", "stats": True}) for x in xs])
        for x, f in zip(xs, futs):
            out, total = f.wait()
            assert torch.allclose(out, x * 2) and torch.allclose(total, x.sum())
        with torch.no_grad():
            assert torch.equal(proxy(xs[0]), xs[0] * 2)  # the batcher still runs calls
    finally:
        rpc.rpc_sync("worker1", host.warnings_as_errors, (False,))


def test_an_eval_mode_batchnorm_joins_and_matches_its_local_module():
    proxy = RemoteModule("worker1/cpu", host.Norm, batching=POLICY).eval()
    proxy.eval()
    xs = [torch.randn(3, 4), torch.randn(3, 4) * 10 + 5]
    futs = _joined(proxy, "h-bn-eval", [((x,), {"name": "bn-eval"}) for x in xs])
    local = torch.nn.BatchNorm1d(4).eval()
    with torch.no_grad():
        for x, f in zip(xs, futs):
            assert torch.allclose(f.wait(), local(x), rtol=1e-4, atol=1e-5)
    assert [len(b) for b in rpc.rpc_sync("worker1", host.log, ("bn-eval",))] == [6, 3]  # (then the check: 3 rows)


def test_a_batcher_closed_with_calls_queued_answers_them_all():
    import threading

    from remote_module._proxy.batching import Batcher

    held, go = threading.Event(), threading.Event()

    def run(args, kwargs):
        if kwargs.get("hold"):
            held.set()
            go.wait(HANG_S)
        return args[0] * 2

    b = Batcher(BatchPolicy(max_batch=4, max_wait_ms=10_000), run, "unit")
    first = b.submit((torch.ones(1, 2),), {"hold": True})
    b.close()  # closed: the first call runs at once, not after max_wait_ms
    assert held.wait(HANG_S)
    assert b.submit((torch.ones(1, 2),), {}) is None  # a closed batcher takes no call
    go.set()
    assert first.wait()[0] == "ok"
    b._thread.join(HANG_S)
    assert not b._thread.is_alive()
