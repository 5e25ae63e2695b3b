"""Hostile review (3) of host-side batching: the first-batch check and the training-mode warning."""

import threading
import time

import pytest
import torch
import torch.distributed.rpc as rpc

from remote_module import BatchPolicy, RemoteModule
from tests._deadlines import HANG_S
from tests._faults import gates
from tests.proxy import _batching_remote as host

pytestmark = pytest.mark.usefixtures("rpc_world")

POLICY = BatchPolicy(dim=0, max_batch=64, max_wait_ms=0)


def _holding(gate: str) -> None:
    deadline = time.monotonic() + HANG_S
    while not rpc.rpc_sync("worker1", gates.holding, (gate,)):
        assert time.monotonic() < deadline, "the call never reached its gate"
        time.sleep(0.01)


def test_the_first_no_grad_forward_async_does_not_wait_for_earlier_calls():
    # the first no-grad call of a batching proxy asks the host's training mode, a blocking call
    # in program order: forward_async waited until every earlier call was answered
    proxy = RemoteModule("worker1/cpu", host.RecordingMLP, (3,), batching=POLICY).eval()
    returned = threading.Event()
    got = []

    def burst():  # (one thread: program order is per thread)
        got.append(proxy.forward_async(torch.zeros(1, 8), gate="h3-order", name="h3-order"))  # grad on
        with torch.no_grad():
            got.append(proxy.forward_async(torch.ones(1, 8), name="h3-order"))
        returned.set()

    t = threading.Thread(target=burst, daemon=True)
    t.start()
    _holding("h3-order")
    try:
        ok = returned.wait(5.0)
    finally:
        rpc.rpc_sync("worker1", gates.release, ("h3-order",))
    t.join(HANG_S)
    for f in got:
        f.wait()
    assert ok, "forward_async under no_grad blocked until an earlier call was answered"


# ---- the first-batch check, on a Batcher driven directly (no RPC) ------------------------------

def _drive(fn, xs, policy=POLICY):
    """Run ``fn`` through a Batcher: a first call holds its thread while ``xs`` queue, then all
    run; each call's answer, the warnings, the batcher's stats and the inputs each run got."""
    import warnings

    from remote_module._proxy.batching import Batcher

    gate, ran = threading.Event(), []

    def run(args, kwargs):
        if kwargs.get("hold"):
            gate.wait(HANG_S)
            return args[0]
        ran.append(args[0].shape[0])
        return fn(args[0])

    b = Batcher(policy, run, "hostile3")
    try:
        first = b.submit((torch.zeros(1, 1),), {"hold": True})
        deadline = time.monotonic() + HANG_S
        while True:  # (until the batcher's thread took the first call)
            with b._cond:
                if not b._queue:
                    break
            assert time.monotonic() < deadline
            time.sleep(0.005)
        futs = [b.submit((x,), {}) for x in xs]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gate.set()
            answers = [f.wait() for f in futs]
            first.wait()
        return answers, [str(w.message) for w in caught], b.stats(), ran
    finally:
        gate.set()
        b.close()


class _NoCompare(torch.Tensor):
    """A tensor whose comparison (``torch.allclose``) raises."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.allclose:
            raise RuntimeError("cannot compare")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_check_whose_comparison_raises_blames_the_comparison_and_runs_no_third_time():
    xs = [torch.randn(2, 3), torch.randn(3, 3), torch.randn(1, 3)]
    answers, warned, stats, ran = _drive(lambda t: (t * 2).as_subclass(_NoCompare), xs)
    assert [kind for kind, _ in answers] == ["ok"] * 3
    for x, (_, out) in zip(xs, answers):
        assert torch.equal(out.as_subclass(torch.Tensor), x * 2)
    refusal = [w for w in warned if "remote_module batching" in w]
    assert len(refusal) == 1 and "first call alone raised" not in refusal[0], refusal
    # joined (6 rows), the first call alone (2), then the others alone (3, 1): the first's rows twice
    assert ran == [6, 2, 3, 1], ran
    assert stats["run_again_alone"] == 3 and stats["refused_kinds"] == 1, stats


def test_a_first_call_that_raises_alone_gets_that_error_and_runs_no_third_time():
    runs = []

    def fn(t):
        runs.append(t.shape[0])
        if len(runs) == 2:  # the check's run alone of the first call
            raise ValueError("alone")
        return t * 2

    xs = [torch.randn(2, 3), torch.randn(3, 3)]
    answers, warned, stats, ran = _drive(fn, xs)
    assert ran == [5, 2, 3], ran  # joined, the first alone (raised: its answer), the second alone
    assert answers[0][0] == "error" and isinstance(answers[0][1], ValueError), answers[0]
    assert answers[1][0] == "ok" and torch.equal(answers[1][1], xs[1] * 2)
    assert stats["run_again_alone"] == 2, stats


def test_the_kinds_checked_stay_bounded_when_a_plain_argument_varies():
    # a plain value (a step, a request id) is part of a call's kind: every value is a new kind,
    # checked once and remembered; a server running for days must not remember them all
    from remote_module._proxy.batching import Batcher, Pending, join_key

    b = Batcher(POLICY, lambda args, kwargs: args[0] * 2, "hostile3-kinds")
    try:
        for step in range(3000):
            batch = []
            for rows in (1, 2):
                args, kwargs = (torch.ones(rows, 3),), {"step": step}
                key, tensors = join_key(args, kwargs, 0)
                batch.append(Pending(args, kwargs, key, tensors, rows, None))
            b._joined(batch)
            assert all(p.future.wait()[0] == "ok" for p in batch)
        assert b.stats()["joined_forwards"] == 3000
        assert len(b._verified) <= 1024, len(b._verified)
    finally:
        b.close()


def test_a_half_precision_module_is_not_refused_for_its_rounding():
    # float16 rows of one call alone and joined differ by rounding (a different kernel for
    # another batch size) well beyond rtol=1e-4: the check refused batching for a module whose
    # rows are independent, saying they were not
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024)).half()
    xs = [torch.randn(1, 1024).half(), torch.randn(15, 1024).half()]
    with torch.no_grad():
        answers, warned, stats, ran = _drive(net, xs)
    assert not [w for w in warned if "remote_module batching" in w], warned
    assert stats["joined_forwards"] == 1 and stats["refused_kinds"] == 0, stats
    assert [kind for kind, _ in answers] == ["ok", "ok"]


def test_calls_of_a_kind_refused_meanwhile_run_alone_not_joined_again():
    # calls already queued when their kind was refused were joined (and checked) again: the
    # module ran their rows twice more, where the warning says they run one by one from now on
    xs = [torch.randn(2, 3) for _ in range(4)]
    answers, warned, stats, ran = _drive(lambda t: t - t.mean(0, keepdim=True), xs,
                                         BatchPolicy(dim=0, max_batch=4, max_wait_ms=0))
    assert [kind for kind, _ in answers] == ["ok"] * 4
    for x, (_, out) in zip(xs, answers):
        assert torch.allclose(out, x - x.mean(0, keepdim=True))
    assert ran == [4, 2, 2, 2, 2], ran  # joined and checked once; then each alone
    assert stats["run_again_alone"] == 2 and stats["not_joinable"] == 2, stats
