"""RemotePipeline's failure semantics (issue 9, "Failures") on the shared world: a stage that
raises, micro-batches cancelled after a failure, a slow or held stage against the pipeline's
timeout, and program order with calls made earlier on a stage's proxy. Killed and SIGSTOPped
stage workers and a shutdown during a forward need worlds of their own: see the slow tests at
the end (tests/_faults/pipeline_world.py).

No check here depends on the machine's speed: a stage is held on a gate (tests/_faults/gates.py)
until the outcome is in, so a forward that fails "within its timeout" failed while the stage
still held its micro-batch; the only upper bounds on time are hang guards (tests/_deadlines.py)."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
import torch.distributed.rpc as rpc

from remote_module import RemoteModule
from remote_module._core.errors import CallTimeout, RemoteModuleError
from remote_module.pipeline import RemotePipeline, _pipeline
from tests._deadlines import HANG_S
from tests._faults import gates
from tests._faults import pipeline_world as pfw
from tests._faults import stages as pfr
from tests._faults.subworld import run_report

_clock = time.monotonic


def configure(worker: str, tag: str, **settings) -> None:
    rpc.rpc_sync(worker, pfr.configure, (tag,), settings)


def counts(worker: str, tag: str) -> dict:
    return rpc.rpc_sync(worker, pfr.counts, (tag,))


def wait_until(predicate, what: str, seconds: float = HANG_S) -> None:
    """Poll ``predicate`` until it holds; ``seconds`` is a hang guard."""
    deadline = _clock() + seconds
    while not predicate():
        if _clock() > deadline:
            raise AssertionError(f"hang guard: not within {seconds} s: {what}")
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

    def idle(self) -> bool:
        """No micro-batch is running on any stage."""
        return all(c["entered"] == c["left"] for c in (self.counts(i) for i in range(len(self.workers))))

    def works(self, x: torch.Tensor) -> None:
        """A forward with the stages plain: equal to the local reference."""
        got = self.pipe(x)
        assert torch.equal(got, x + sum(self.adds)), (got, x + sum(self.adds))


@pytest.fixture(scope="module")
def three(rpc_world):
    """Stages on worker1, worker2 and worker1 again: stage 0 and stage 2 share a host."""
    pipe = Pipe("pf3", ["worker1", "worker2", "worker1"], chunks=4, timeout=HANG_S)
    yield pipe
    pipe.reset()


@pytest.fixture(scope="module")
def two(rpc_world):
    pipe = Pipe("pf2", ["worker1", "worker2"], chunks=2, timeout=HANG_S)
    yield pipe
    pipe.reset()


def batch(n: int) -> torch.Tensor:
    """``n`` rows holding 0..n-1: with ``chunks=n`` micro-batch i holds the value i."""
    return torch.arange(float(n)).reshape(n, 1)


def next_run(monkeypatch) -> tuple[str, int]:
    """(caller, run): what the hosts will know this process's next forward by (its run id is
    drawn here and handed to that forward; the later ones draw on as before)."""
    run = next(_pipeline._runs)
    monkeypatch.setattr(_pipeline, "_runs", itertools.chain([run], _pipeline._runs))
    return rpc.get_worker_info().name, run


def hold_until_cancelled(world: "Pipe", stage: int, value: float, key: str, monkeypatch) -> None:
    """Stage ``stage`` holds the micro-batch holding ``value`` on the gate ``key`` until the
    next forward is cancelled on its host: the caller has then seen a failure, and the
    micro-batches queued behind the held one are still waiting, however fast or slow the
    machine (a pause per micro-batch let a slow caller see the failure only after they ran)."""
    caller, run = next_run(monkeypatch)
    rpc.rpc_sync(world.workers[stage], gates.release_at_cancel, (key, caller, run))
    world.set(stage, gate=key, gate_on=value)


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


def test_a_failing_micro_batch_cancels_the_later_ones_and_forward_returns_once_all_settled(three, monkeypatch):
    x = batch(8)
    three.pipe.chunks = 8
    three.pipe.timeout = HANG_S  # not under test: no micro-batch may time out on a slow machine
    key = "pf-cancel-8"
    before = [three.counts(i)["entered"] for i in range(3)]
    hold_until_cancelled(three, 0, 2.0, key, monkeypatch)  # micro-batches queue on stage 0 behind 2
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
        rpc.rpc_sync(three.workers[0], gates.release, (key,))
    three.works(batch(4))


def test_many_micro_batches_stay_within_the_window_and_a_failure_still_cancels_the_rest(three, monkeypatch):
    # 40 micro-batches, more than a host's 16 RPC threads: at most _window(3) are in flight, so
    # the failure's answer and the cancellation are not stuck behind threads waiting for turns.
    from remote_module.pipeline._pipeline import _window

    sent: list[int] = []
    send = _pipeline.call_async

    def counted(*args, **kwargs):
        sent.append(args[2][2])  # (route, stage, micro-batch, ...): the micro-batch sent
        return send(*args, **kwargs)

    monkeypatch.setattr(_pipeline, "call_async", counted)
    x = batch(40)
    three.pipe.chunks = 40
    three.pipe.timeout = HANG_S  # not under test: no micro-batch may time out on a slow machine
    key = "pf-cancel-40"
    before = [three.counts(i)["entered"] for i in range(3)]
    # stage 0 holds micro-batch 3 until the caller has seen micro-batch 2 fail: whatever the
    # machine's speed, nothing settles meanwhile that would let the caller send more
    hold_until_cancelled(three, 0, 3.0, key, monkeypatch)
    three.set(1, fail_on=2.0 + three.adds[0], error="StageError")  # micro-batch 2 fails on stage 1
    try:
        with pytest.raises(pfr.StageError, match="pipeline stage 1 on worker 'worker2'"):
            three.pipe(x)
        after = [three.counts(i) for i in range(3)]
        assert all(c["entered"] == c["left"] for c in after), after
        ran = [c["entered"] - b for c, b in zip(after, before)]
        # micro-batches 0..2 plus at most one window (5 for 3 stages) sent before the failure
        # was seen; with all 40 in flight at once, about 26 ran here
        assert _window(3) == 5 and len(sent) <= 3 + 5, f"micro-batches sent: {sent}"
        assert ran[0] <= 3 + 5, f"micro-batches run per stage: {ran}"
        stable_counts(three.where(), window=0.6)
    finally:
        three.pipe.chunks = 4
        three.reset()
        rpc.rpc_sync(three.workers[0], gates.release, (key,))
    three.works(batch(4))


# ---- a slow or held stage against the pipeline's timeout -------------------------------------


def _fails_while_held(world: Pipe, stage: int, key: str, x: torch.Tensor, timeout: float,
                      meanwhile=None) -> tuple[pytest.ExceptionInfo, int]:
    """The forward of ``x`` with stage ``stage`` held on a gate until the forward failed, so
    slower than the timeout at any speed: its ``CallTimeout``, and the stage's count of
    forwards entered before it. ``meanwhile()`` runs after the failure, the stage still held.

    The forward runs with ``timeout``; if it failed before the held stage had its micro-batch,
    or blaming another stage (this machine was too slow to bring the micro-batch there, or the
    failure back, within the time the pipeline leaves for that), the late micro-batches are let
    through and it runs again with the timeout doubled, while that stays within HANG_S."""
    worker = world.workers[stage]
    for tries in itertools.count(1):
        wait_until(world.idle, "the stages finished the earlier micro-batches")
        gate = f"{key}-{tries}"  # a gate opens once
        before = world.counts(stage)["entered"]
        world.pipe.timeout = timeout
        world.set(stage, gate=gate)
        try:
            with pytest.raises(CallTimeout) as info:
                world.pipe(x)
            held = rpc.rpc_sync(worker, gates.holding, (gate,))
            conclusive = held and pfw.blamed(str(info.value)) == [stage, worker]
            if conclusive and meanwhile is not None:
                meanwhile()
        finally:
            world.reset()
            rpc.rpc_sync(worker, gates.release, (gate,))
        if conclusive:
            return info, before
        assert 2 * timeout <= HANG_S, (
            f"hang guard: up to a timeout of {timeout:g} s, no forward failed while stage {stage} held its "
            f"micro-batch, blaming it: {info.value}")
        timeout *= 2
    raise AssertionError("unreachable")


def test_a_slow_last_stage_times_out_naming_it_and_late_answers_are_dropped(two):
    x = batch(2)
    info, _ = _fails_while_held(two, 1, "pf-slow-last", x, 1.5)
    # named by stage 0, which waited for it: not the caller's own timeout naming stage 0
    assert "pipeline stage 1 on worker 'worker2'" in str(info.value), str(info.value)
    two.works(x)  # waits for the late micro-batch's turn to end; its output is dropped
    wait_until(lambda: two.counts(1)["entered"] == two.counts(1)["left"], "stage 1 idle")


def test_a_micro_batch_queued_behind_a_slow_one_on_stage_0_times_out_too(two):
    x = batch(2)
    info, before = _fails_while_held(two, 0, "pf-slow-first", x, 1.0)
    assert "pipeline stage 0 on worker 'worker1'" in str(info.value), str(info.value)
    wait_until(lambda: two.counts(0)["left"] == two.counts(0)["entered"], "stage 0 finished micro-batch 0")
    # the other micro-batch timed out in the queue and never ran, not even once stage 0 came free
    assert len(two.counts(0)["seen"][before:]) == 1, two.counts(0)
    two.works(x)


def test_a_stage_that_finishes_too_late_to_hand_on_is_the_one_named(two):
    # stage 0 finishes after the time it may hand on (its deadline less a margin) but before the
    # caller's deadline: it reports itself, not stage 1, which was never sent anything (on a
    # slow machine the caller's own deadline may come first: that error names stage 0 too)
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
    worker = two.workers[stage]
    other = RemoteModule("worker2/cpu", torch.nn.Identity, timeout=HANG_S)

    def other_works() -> None:  # held: one stage, not the world
        assert torch.equal(other(torch.ones(2)), torch.ones(2))

    # (the forward failed while the stage held its micro-batch: _fails_while_held checks it)
    info, _ = _fails_while_held(two, stage, f"pf-held-{stage}", batch(2), 2.0, meanwhile=other_works)
    assert f"pipeline stage {stage} on worker {worker!r}" in str(info.value), str(info.value)
    two.works(batch(2))


# ---- program order ---------------------------------------------------------------------------


def test_calls_made_earlier_on_a_stage_proxy_are_answered_before_the_pipeline_runs_on_it(rpc_world):
    tag = "pf-order"
    first = RemoteModule("worker1/cpu", pfr.Step, (tag, 1.0), timeout=HANG_S)
    pipe = RemotePipeline([first, ("worker2/cpu", pfr.Step, ("pf-order-1", 2.0), None)], chunks=2, timeout=HANG_S)
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
    # its phases one after the other, each with a few hang-guarded waits
    return run_report("tests._faults.pipeline_world", list(pfw.ROLES["faults"]), timeout=4 * HANG_S, args=("faults",))


def phase(report: dict, name: str) -> dict:
    result = report[name]
    assert "error" not in result, f"phase {name!r} failed in the world:\n{result['error']}"
    return result


def assert_failed_naming(outcome: dict, stage: int, worker: str) -> None:
    """``outcome`` (the world ran it while stage ``stage`` was frozen or dead: thawed only once
    it was in) failed, blaming that stage (the world ran it again with a longer timeout while a
    healthy stage was blamed: too slow a machine for the timeout it had)."""
    assert not outcome["ok"], f"the forward succeeded although stage {stage} ({worker}) was down: {outcome}"
    assert outcome["seconds"] < outcome["timeout"] + HANG_S, f"hang guard: {outcome}"
    assert f"pipeline stage {stage} on worker {worker!r}" in outcome["message"], outcome["message"]
    assert outcome["blamed"] == [stage, worker], f"up to a timeout of {outcome['timeout']} s: {outcome}"


@pytest.mark.slow
@pytest.mark.parametrize("name, stage, worker", [("frozen_first", 0, "h1"), ("frozen_last", 2, "h3")])
def test_a_frozen_stage_worker_is_named_within_the_timeout_and_the_pipeline_recovers(faults, name, stage, worker):
    assert faults["warm"]["ok"] and faults["warm"]["value"], f"the pipeline failed before any fault: {faults['warm']}"
    report = phase(faults, name)
    assert_failed_naming(report["forward"], stage, worker)
    assert report["forward"]["type"] == "CallTimeout", report["forward"]
    assert report["other"]["ok"] and report["other"]["value"], f"a proxy on h2 failed meanwhile: {report['other']}"
    # thawed: the late micro-batches were dropped, the next forward is answered correctly
    assert report["after"]["ok"] and report["after"]["value"], report["after"]


@pytest.mark.slow
@pytest.mark.parametrize("name, stage, worker", [("killed_last", 2, "h3"), ("killed_first", 0, "h1")])
def test_a_killed_stage_worker_is_named_within_the_timeout_and_other_proxies_still_work(faults, name, stage, worker):
    report = phase(faults, name)
    assert_failed_naming(report["forward"], stage, worker)
    assert_failed_naming(report["again"], stage, worker)  # the host now known dead
    assert report["other"]["ok"] and report["other"]["value"], f"a proxy on h2 failed afterwards: {report['other']}"
    if name == "killed_first":
        assert faults["two_warm"]["ok"] and faults["two_warm"]["value"], faults["two_warm"]


@pytest.mark.slow
def test_a_forward_running_when_rpc_shuts_down_gracefully_is_answered():
    report = run_report("tests._faults.pipeline_world", list(pfw.ROLES["shutdown"]), timeout=2 * HANG_S,
                        args=("shutdown",))
    assert "error" not in report, report["error"]
    assert report["outstanding_at_shutdown"] > 0, f"nothing was left to answer at the shutdown: {report}"
    assert not report["forward_alive"], "the forward still runs after rpc.shutdown() returned"
    assert report["forward"]["ok"] and report["forward"]["value"], report["forward"]
