"""How a RemotePipeline's micro-batches travel: activations go from host to host and never
through the caller; micro-batches overlap across stages while each stage runs one at a time,
in order. No timing assertions: the hosts record what ran when (one monotonic clock for the
processes of a machine) and the tests compare the intervals."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

from remote_module.pipeline import RemotePipeline
from tests._deadlines import HANG_S
from tests._faults import gates
from tests._marks import GRAD_ON_WITHOUT_CONTEXT
from tests.pipeline import _remote as remote
from tests.pipeline._remote import Absorb, Emit, FailsOn, Timed, on_host, recorded, seeded_linear

pytestmark = [pytest.mark.usefixtures("rpc_world"), GRAD_ON_WITHOUT_CONTEXT]

W1, W2 = "worker1/cpu", "worker2/cpu"
WORKERS = ("worker0", "worker1", "worker2")


@pytest.fixture(autouse=True)
def _same_inputs_every_run():
    torch.manual_seed(0)


def arrivals() -> dict[str, list[str]]:
    """Per worker of the test world: where a Tracer was unpickled in that process."""
    return {w: remote.arrivals() if w == "worker0" else rpc.rpc_sync(w, remote.arrivals) for w in WORKERS}


def clear_arrivals() -> None:
    remote.clear_arrivals()
    for w in WORKERS[1:]:
        rpc.rpc_sync(w, remote.clear_arrivals)


# ---- an intermediate activation never reaches the caller -------------------------------------


@pytest.fixture
def traced():
    """Stage 0 (worker1) outputs a Tracer; stage 1 (worker2) records what type it received."""
    clear_arrivals()
    # positive control on the caller: a Tracer that does come here is seen
    rpc.rpc_sync("worker2", remote.make_tracer)
    assert remote.arrivals() == ["worker0"]
    clear_arrivals()
    yield RemotePipeline([(W1, Emit, (4, 1), None), (W2, Absorb, (4, 2), None)], chunks=4)
    clear_arrivals()


def expected_of(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return seeded_linear(4, 2, 2)(torch.relu(seeded_linear(4, 4, 1)(x)))


def check_arrivals(pipe: RemotePipeline, micro_batches: int) -> None:
    seen = arrivals()
    assert seen["worker0"] == [], "an intermediate activation was unpickled on the caller"
    assert seen["worker1"] == []
    # positive control: the activation did travel as a Tracer, straight to stage 1's host
    assert seen["worker2"] == ["worker2"] * micro_batches
    assert on_host(pipe.stages[1], recorded, "received") == ["Tracer"] * micro_batches


def test_an_activation_goes_from_host_to_host_never_through_the_caller(traced):
    x = torch.randn(8, 4)
    out = traced(x)
    assert type(out) is torch.Tensor
    torch.testing.assert_close(out, expected_of(x), atol=1e-5, rtol=0)
    check_arrivals(traced, 4)


def test_nor_when_training_with_distributed_autograd(traced):
    x = torch.randn(8, 4)
    with dist_autograd.context() as ctx:
        out = traced(x)
        assert out.requires_grad
        dist_autograd.backward(ctx, [out.sum()])
        grads = [on_host(stage, remote.gradients, ctx) for stage in traced.stages]
    assert all(g is not None for stage in grads for g in stage.values())  # backward went back along the chain
    torch.testing.assert_close(out.detach(), expected_of(x), atol=1e-5, rtol=0)
    check_arrivals(traced, 4)


# ---- micro-batches overlap; a stage runs one at a time, in order ----------------------------------


def overlaps(a: tuple, b: tuple) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def test_micro_batches_overlap_across_stages_one_at_a_time_per_stage():
    # stage 1 holds micro-batch 0 and stage 0 micro-batch 1 (on gates) until both are running
    # at once: a pipeline that did not overlap them never gets there, whatever the speed
    holds = {"worker2": "flow-overlap-1", "worker1": "flow-overlap-0"}
    pipe = RemotePipeline([(W1, Timed, (0.0, (holds["worker1"], 4.0)), None),
                           (W2, Timed, (0.0, (holds["worker2"], 0.0)), None)], chunks=4)
    x = torch.arange(16, dtype=torch.float32).reshape(8, 2)  # micro-batch i starts with row 2i: 4i
    box = {}
    thread = threading.Thread(target=lambda: box.update(out=pipe(x)))
    thread.start()
    try:
        deadline = time.monotonic() + HANG_S
        while not all(rpc.rpc_sync(w, gates.holding, (key,)) for w, key in holds.items()):
            assert time.monotonic() < deadline, (
                "hang guard: stage 0 never ran micro-batch 1 while stage 1 ran micro-batch 0")
            time.sleep(0.01)
    finally:
        for w, key in holds.items():
            rpc.rpc_sync(w, gates.release, (key,))
        thread.join(HANG_S)
    assert torch.equal(box["out"], x)
    first, second = (on_host(stage, recorded, "calls") for stage in pipe.stages)
    for calls in (first, second):
        assert [marker for _, _, marker, _ in calls] == [0.0, 4.0, 8.0, 12.0]  # micro-batch order
        for earlier, later in zip(calls, calls[1:]):
            assert earlier[1] <= later[0], f"a stage ran two micro-batches at once: {earlier} {later}"
    # micro-batch i on stage 1 comes after micro-batch i on stage 0 ...
    assert all(a[1] <= b[0] for a, b in zip(first, second))
    # ... and while stage 1 runs one micro-batch, stage 0 runs a later one
    assert any(overlaps(a, b) for a in first for b in second), f"no overlap: {first} {second}"


def test_each_stage_runs_the_micro_batches_in_order_whatever_order_they_arrive_in():
    # Stage 0 receives every micro-batch at once, on concurrent handler threads: without an
    # order of its own it runs them in whichever order the threads get there.
    pipe = RemotePipeline([(W1, Timed, (0.0,), None), (W2, Timed, (0.0,), None), (W2, Timed, (0.0,), None)], chunks=8)
    x = torch.arange(32, dtype=torch.float32).reshape(16, 2)
    for _ in range(10):
        assert torch.equal(pipe(x), x)
    for stage in pipe.stages:
        markers = [marker for _, _, marker, _ in on_host(stage, recorded, "calls")]
        assert markers == [4.0 * i for i in range(8)] * 10


def test_micro_batches_waiting_for_one_that_failed_earlier_are_cancelled_not_run():
    # Micro-batch 0 fails on stage 1; micro-batches 1-3 reach stage 2 but wait there for micro-batch
    # 0, which never comes, until the forward is cancelled: stage 2 runs nothing, and the
    # caller hears of the failure long before the pipeline's timeout. Waiting for their turn
    # until their deadline (the pipeline's 2 * HANG_S, less a margin per hop), they would keep
    # the forward from returning until long after HANG_S, the hang guard, at any speed.
    pipe = RemotePipeline(
        [(W1, Timed, (0.0,), None), (W2, FailsOn, (0.0,), None), (W1, Timed, (0.0,), None)], chunks=4,
        timeout=2 * HANG_S,
    )
    x = torch.arange(16, dtype=torch.float32).reshape(8, 2)
    started = time.monotonic()
    with pytest.raises(ValueError, match="refused on purpose"):
        pipe(x)
    assert time.monotonic() - started < HANG_S, (
        "hang guard: the waiting micro-batches were not woken by the cancellation")
    assert on_host(pipe.stages[0], recorded, "calls")[0][2] == 0.0
    assert on_host(pipe.stages[2], recorded, "calls") == []
