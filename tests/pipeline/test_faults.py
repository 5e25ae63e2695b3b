"""RemotePipeline's failure semantics (issue 9, "Failures") on the shared world: a stage that
raises, micro-batches cancelled after a failure, a slow or held stage against the pipeline's
timeout, and program order with calls made earlier on a stage's proxy. Killed and SIGSTOPped
stage workers and a shutdown during a forward need worlds of their own: see the slow tests at
the end (tests/_faults/pipeline_world.py)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed.rpc as rpc

from remote_module import RemoteModule
from remote_module._core.errors import CallTimeout, RemoteModuleError
from remote_module.pipeline import RemotePipeline
from tests._faults import gates
from tests._faults import pipeline_world as pfw
from tests._faults import stages as pfr
from tests._faults.subworld import run_report

_clock = time.monotonic
#: a failure is reported at the latest this long after the pipeline's timeout (a loaded 2-core
#: machine: the caller's own deadline watcher ticks every 50 ms, callbacks queue behind others)
SLACK = 1.0


def configure(worker: str, tag: str, **settings) -> None:
    rpc.rpc_sync(worker, pfr.configure, (tag,), settings)


def counts(worker: str, tag: str) -> dict:
    return rpc.rpc_sync(worker, pfr.counts, (tag,))


def wait_until(predicate, seconds: float, what: str) -> None:
    deadline = _clock() + seconds
    while not predicate():
        if _clock() > deadline:
            raise AssertionError(f"not within {seconds} s: {what}")
        time.sleep(0.02)


def stable_counts(where: list[tuple[str, str]], window: float) -> list[dict]:
    """The counters of ``where`` ((worker, tag) pairs), checked unchanged over ``window`` seconds:
    no micro-batch of a forward that already returned runs late."""
    before = [counts(w, t) for w, t in where]
    time.sleep(window)  # proving an absence: nothing to poll for
    after = [counts(w, t) for w, t in where]
    assert after == before, f"stages ran after forward returned: {before} -> {after}"
    return after


class Pipe:
    """A pipeline of :class:`pfr.Step` stages with known tags, and its local reference."""

    def __init__(self, name: str, workers: list[str], chunks: int, timeout: float) -> None:
        self.workers = workers
        self.tags = [f"{name}-{i}" for i in range(len(workers))]
        self.adds = [float(10 ** i) for i in range(len(workers))]
        self.pipe = RemotePipeline(
            [(f"{w}/cpu", pfr.Step, (tag, add), None) for w, tag, add in zip(workers, self.tags, self.adds)],
            chunks=chunks,
            timeout=timeout,
        )
        self.timeout = timeout

    def set(self, stage: int, **settings) -> None:
        configure(self.workers[stage], self.tags[stage], **settings)

    def reset(self) -> None:
        for i in range(len(self.workers)):
            self.set(i)
        self.pipe.timeout = self.timeout

    def counts(self, stage: int) -> dict:
        return counts(self.workers[stage], self.tags[stage])

    def where(self) -> list[tuple[str, str]]:
        return list(zip(self.workers, self.tags))

    def works(self, x: torch.Tensor) -> None:
        """A forward with the stages plain: equal to the local reference."""
        got = self.pipe(x)
        assert torch.equal(got, x + sum(self.adds)), (got, x + sum(self.adds))


@pytest.fixture(scope="module")
def three(rpc_world):
    """Stages on worker1, worker2 and worker1 again: stage 0 and stage 2 share a host."""
    pipe = Pipe("pf3", ["worker1", "worker2", "worker1"], chunks=4, timeout=10.0)
    yield pipe
    pipe.reset()


@pytest.fixture(scope="module")
def two(rpc_world):
    pipe = Pipe("pf2", ["worker1", "worker2"], chunks=2, timeout=10.0)
    yield pipe
    pipe.reset()


def batch(n: int) -> torch.Tensor:
    """``n`` rows holding 0..n-1: with ``chunks=n`` micro-batch i holds the value i."""
    return torch.arange(float(n)).reshape(n, 1)


# ---- a stage whose forward raises ------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, expected, stage",
    [("ValueError", ValueError, 1), ("StageError", pfr.StageError, 2), ("SystemExit", RemoteModuleError, 0)],
)
def test_a_stage_that_raises_gives_the_original_type_naming_stage_and_worker(three, kind, expected, stage):
    x = batch(4)
    value = float(1 + sum(three.adds[:stage]))  # what micro-batch 1 holds when it reaches ``stage``
    three.set(stage, fail_on=value, error=kind)
    try:
        with pytest.raises(expected) as info:
            three.pipe(x)
    finally:
        three.reset()
    message = str(info.value)
    assert f"refuses {value:g}" in message, message  # the stage's own message
    assert f"pipeline stage {stage} on worker {three.workers[stage]!r}" in message, message
    assert "micro-batch 1 of 4" in message, message
    if kind == "SystemExit":  # as everywhere in the project: never a SystemExit on the caller
        assert type(info.value).__name__ == "SystemExit" and info.value.remote_type == "builtins.SystemExit"
    three.works(x)  # the pipeline works afterwards


def test_a_failing_micro_batch_cancels_the_later_ones_and_forward_returns_once_all_settled(three):
    x = batch(8)
    three.pipe.chunks = 8
    before = [three.counts(i)["entered"] for i in range(3)]
    three.set(0, pause=0.2)  # micro-batches queue on stage 0
    three.set(1, fail_on=1.0 + three.adds[0], error="StageError")  # micro-batch 1 fails on stage 1
    try:
        with pytest.raises(pfr.StageError, match="pipeline stage 1 on worker 'worker2'"):
            three.pipe(x)
        after = [three.counts(i) for i in range(3)]
        # settled: no micro-batch was still running on any stage when forward returned
        assert all(c["entered"] == c["left"] for c in after), after
        ran = [c["entered"] - b for c, b in zip(after, before)]
        # the micro-batches queued on stage 0 behind the failure were cancelled, not run, and
        # stage 2 ran neither micro-batch 1 (failed) nor the cancelled ones
        assert ran[0] < 8 and ran[2] < 7, f"micro-batches run per stage: {ran}"
        seen = after[0]["seen"][-ran[0]:]
        assert len(set(seen)) == len(seen), f"stage 0 ran a micro-batch twice: {seen}"
        stable_counts(three.where(), window=0.6)  # nothing ran late, on any stage
    finally:
        three.pipe.chunks = 4
        three.reset()
    three.works(batch(4))


def test_many_micro_batches_stay_within_the_window_and_a_failure_still_cancels_the_rest(three):
    # 40 micro-batches, more than a host's 16 RPC threads: at most _window(3) are in flight, so
    # the failure's answer and the cancellation are not stuck behind threads waiting for turns.
    from remote_module.pipeline._pipeline import _window

    x = batch(40)
    three.pipe.chunks = 40
    before = [three.counts(i)["entered"] for i in range(3)]
    three.set(0, pause=0.02)
    three.set(1, fail_on=2.0 + three.adds[0], error="StageError")  # micro-batch 2 fails on stage 1
    try:
        with pytest.raises(pfr.StageError, match="pipeline stage 1 on worker 'worker2'"):
            three.pipe(x)
        after = [three.counts(i) for i in range(3)]
        assert all(c["entered"] == c["left"] for c in after), after
        ran = [c["entered"] - b for c, b in zip(after, before)]
        # micro-batches 0..2 plus at most one window (5 for 3 stages) sent before the failure
        # was seen; with all 40 in flight at once, about 26 ran here
        assert _window(3) == 5 and ran[0] <= 3 + 5, f"micro-batches run per stage: {ran}"
        stable_counts(three.where(), window=0.6)
    finally:
        three.pipe.chunks = 4
        three.reset()
    three.works(batch(4))


# ---- a slow or held stage against the pipeline's timeout -------------------------------------


def _fails_while_held(world, stage: int, key: str, x: torch.Tensor) -> tuple[pytest.ExceptionInfo, float]:
    """The forward of ``x`` with stage ``stage`` held on the gate ``key`` until the forward
    failed (slower than the timeout at any speed): its ``CallTimeout`` and the seconds it took."""
    world.set(stage, gate=key)
    start = _clock()
    try:
        with pytest.raises(CallTimeout) as info:
            world.pipe(x)
        elapsed = _clock() - start
    finally:
        world.reset()
        rpc.rpc_sync(world.workers[stage], gates.release, (key,))
    return info, elapsed


def test_a_slow_last_stage_times_out_naming_it_and_late_answers_are_dropped(two):
    x = batch(2)
    two.pipe.timeout = 1.5
    info, elapsed = _fails_while_held(two, 1, "pf-slow-last", x)
    assert elapsed < 1.5 + SLACK, elapsed
    # named by stage 0, which waited for it: not the caller's own timeout naming stage 0
    assert "pipeline stage 1 on worker 'worker2'" in str(info.value), str(info.value)
    two.works(x)  # waits for the late micro-batch's turn to end; its output is dropped
    wait_until(lambda: two.counts(1)["entered"] == two.counts(1)["left"], 10, "stage 1 idle")


def test_a_micro_batch_queued_behind_a_slow_one_on_stage_0_times_out_too(two):
    x = batch(2)
    two.pipe.timeout = 1.0
    before = two.counts(0)["entered"]
    info, elapsed = _fails_while_held(two, 0, "pf-slow-first", x)
    assert elapsed < 1.0 + SLACK, elapsed
    assert "pipeline stage 0 on worker 'worker1'" in str(info.value), str(info.value)
    wait_until(lambda: two.counts(0)["left"] == two.counts(0)["entered"], 10, "stage 0 finished micro-batch 0")
    # the other micro-batch timed out in the queue and never ran, not even once stage 0 came free
    assert len(two.counts(0)["seen"][before:]) == 1, two.counts(0)
    two.works(x)


def test_a_stage_that_finishes_too_late_to_hand_on_is_the_one_named(two):
    # stage 0 finishes after the time it may hand on (its deadline less a margin) but before the
    # caller's deadline: it reports itself, not stage 1, which was never sent anything
    two.pipe.timeout = 2.0
    two.pipe.chunks = 1
    two.set(0, pause=1.75)
    before = two.counts(1)["entered"]
    try:
        with pytest.raises(CallTimeout) as info:
            two.pipe(batch(1))
    finally:
        two.reset()
        two.pipe.chunks = 2
    assert "pipeline stage 0 on worker 'worker1'" in str(info.value), str(info.value)
    assert "stage 1 on worker 'worker2' (" not in str(info.value), str(info.value)
    assert two.counts(1)["entered"] == before, "stage 1 ran a micro-batch that came too late"
    two.works(batch(2))


@pytest.mark.parametrize("stage", [0, 1])
def test_a_held_stage_fails_the_forward_within_its_timeout_and_other_proxies_still_work(two, stage):
    key = f"pf-held-{stage}"
    worker = two.workers[stage]
    two.pipe.timeout = 2.0
    two.set(stage, gate=key)
    other = RemoteModule("worker2/cpu", torch.nn.Identity, timeout=5)
    start = _clock()
    try:
        with pytest.raises(CallTimeout) as info:
            two.pipe(batch(2))
        elapsed = _clock() - start
        assert rpc.rpc_sync(worker, gates.holding, (key,)), "the stage was not held"
        assert torch.equal(other(torch.ones(2)), torch.ones(2))  # held: one stage, not the world
    finally:
        two.reset()
        rpc.rpc_sync(worker, gates.release, (key,))
    assert elapsed < 2.0 + SLACK, elapsed
    assert f"pipeline stage {stage} on worker {worker!r}" in str(info.value), str(info.value)
    two.works(batch(2))


# ---- program order ---------------------------------------------------------------------------


def test_calls_made_earlier_on_a_stage_proxy_are_answered_before_the_pipeline_runs_on_it(rpc_world):
    tag = "pf-order"
    first = RemoteModule("worker1/cpu", pfr.Step, (tag, 1.0), timeout=10)
    pipe = RemotePipeline([first, ("worker2/cpu", pfr.Step, ("pf-order-1", 2.0), None)], chunks=2, timeout=10)
    configure("worker1", tag, pause=0.1)
    try:
        earlier = [first.forward_async(torch.full((1, 1), 100.0 + i)) for i in range(3)]
        out = pipe(batch(2))
    finally:
        configure("worker1", tag)
    assert torch.equal(out, batch(2) + 3.0)
    assert [f.wait().item() for f in earlier] == [101.0, 102.0, 103.0]
    log = rpc.rpc_sync("worker1", pfr.events, (tag,))
    last_earlier_exit = max(i for i, (kind, v) in enumerate(log) if kind == "exit" and v >= 100)
    first_pipeline_enter = min(i for i, (kind, v) in enumerate(log) if kind == "enter" and v < 100)
    assert last_earlier_exit < first_pipeline_enter, f"the pipeline ran among earlier calls: {log}"


# ---- stage workers frozen or killed, and a shutdown during a forward: worlds of their own ------


@pytest.fixture(scope="module")
def faults():
    """One world for the frozen and killed phases (in turn; see tests/_faults/pipeline_world.py)."""
    return run_report("tests._faults.pipeline_world", list(pfw.ROLES["faults"]), timeout=180, args=("faults",))


def phase(report: dict, name: str) -> dict:
    result = report[name]
    assert "error" not in result, f"phase {name!r} failed in the world:\n{result['error']}"
    return result


def assert_failed_naming(outcome: dict, stage: int, worker: str, timeout: float) -> None:
    assert not outcome["ok"], f"the forward succeeded although stage {stage} ({worker}) was down: {outcome}"
    assert outcome["seconds"] < timeout + SLACK, f"the failure came too late: {outcome}"
    assert f"pipeline stage {stage} on worker {worker!r}" in outcome["message"], outcome["message"]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name, stage, worker", [("frozen_first", 0, "h1"), ("frozen_last", 2, "h3")])
def test_a_frozen_stage_worker_is_named_within_the_timeout_and_the_pipeline_recovers(faults, name, stage, worker):
    assert faults["warm"]["ok"] and faults["warm"]["value"], f"the pipeline failed before any fault: {faults['warm']}"
    report = phase(faults, name)
    assert_failed_naming(report["forward"], stage, worker, faults["timeout"])
    assert report["forward"]["type"] == "CallTimeout", report["forward"]
    assert report["other"]["ok"] and report["other"]["value"], f"a proxy on h2 failed meanwhile: {report['other']}"
    # thawed: the late micro-batches were dropped, the next forward is answered correctly
    assert report["after"]["ok"] and report["after"]["value"], report["after"]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name, stage, worker", [("killed_last", 2, "h3"), ("killed_first", 0, "h1")])
def test_a_killed_stage_worker_is_named_within_the_timeout_and_other_proxies_still_work(faults, name, stage, worker):
    report = phase(faults, name)
    assert_failed_naming(report["forward"], stage, worker, faults["timeout"])
    assert_failed_naming(report["again"], stage, worker, faults["timeout"])  # the host now known dead
    assert report["other"]["ok"] and report["other"]["value"], f"a proxy on h2 failed afterwards: {report['other']}"
    if name == "killed_first":
        assert faults["two_warm"]["ok"] and faults["two_warm"]["value"], faults["two_warm"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_forward_running_when_rpc_shuts_down_gracefully_is_answered():
    report = run_report("tests._faults.pipeline_world", list(pfw.ROLES["shutdown"]), timeout=150, args=("shutdown",))
    assert "error" not in report, report["error"]
    assert report["outstanding_at_shutdown"] > 0, f"nothing was left to answer at the shutdown: {report}"
    assert not report["forward_alive"], "the forward still runs after rpc.shutdown() returned"
    assert report["forward"]["ok"] and report["forward"]["value"], report["forward"]
