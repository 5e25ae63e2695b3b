"""remote_module._core.fanout: N host calls at once, results in order, the first failure naming its
worker and index, a timeout per call."""

import threading
import time

import pytest
import torch
import torch.distributed.rpc as rpc

from remote_module._core import answers
from remote_module._core.errors import CallTimeout, RemoteModuleError
from remote_module._core.fanout import (
    HostCall,
    call_all,
    call_all_async,
    call_grouped,
    call_grouped_each,
    call_one,
    send_to_each,
)
from remote_module._core.settling import WATCH_TICK_S
from tests._deadlines import HANG_S
from tests._faults import gates
from tests.proxy import _held
from tests.proxy._held import hold, wait_until
from tests.proxy._remote import UserError, echo

pytestmark = pytest.mark.usefixtures("rpc_world")

#: the timeout of the calls that a host holds until they failed (the hold is released only
#: once the outcome is in, so a late answer cannot have ended them)
SHORT = 0.5


@pytest.fixture
def unanswered_at_deadline(monkeypatch):
    """For each batch of calls failed at its deadline here: ``(its workers, the indices of the
    calls not answered then)``, as the batch itself recorded them (a batch's results do not
    change once its deadline has passed). Which calls a host answered before a short deadline
    depends on the machine's speed; which one the error must name follows from this."""
    seen = []
    real = answers.Batch.expire

    def expire(batch, now):
        real(batch, now)
        seen.append((list(batch.names), [i for i, r in enumerate(batch.results) if r is answers.UNANSWERED]))

    monkeypatch.setattr(answers.Batch, "expire", expire)
    return seen


def named_at_deadline(seen, names):
    """The call a timeout error must name: the first not answered at the deadline of the batch
    to ``names`` (which must have expired exactly once)."""
    found = [unanswered for workers, unanswered in seen if workers == names and unanswered]
    assert len(found) == 1, seen
    return found[0]


def held_outcome(run, key, worker="worker1"):
    """``run()``'s outcome (see :func:`_outcome`) and its seconds; ``worker`` holds the call on
    ``key`` until the outcome is in, and must still be holding it then."""
    start = time.monotonic()
    try:
        outcome = _outcome(run)
        elapsed = time.monotonic() - start
        wait_until(lambda: rpc.rpc_sync(worker, gates.holding, (key,)), f"the call held on {key!r} waiting on {worker}")
    finally:
        rpc.rpc_sync(worker, gates.release, (key,))
    return outcome, elapsed


def assert_at_deadline(elapsed, timeout=SHORT):
    """Not before the timeout; the only upper bound is the hang guard."""
    assert timeout - WATCH_TICK_S <= elapsed, f"failed {elapsed:.3f} s after it was made, before its timeout"
    assert elapsed < timeout + HANG_S, f"hang guard: failed only after {elapsed:.1f} s"


def test_results_come_back_in_the_order_of_the_calls():
    # the first call is held (on a gate) until the calls to worker2 and worker0 returned, so the
    # hosts answer out of order whatever the machine's speed
    key = "fanout-order"
    workers = ["worker1", "worker2", "worker0", "worker1"]
    calls = [HostCall(w, _held.timed, (i, key if i == 0 else None)) for i, w in enumerate(workers)]
    fut = call_all_async(calls, timeout=HANG_S)
    try:
        wait_until(lambda: all(rpc.rpc_sync(workers[i], _held.finished, ([i],)) == [i] for i in (1, 2)),
                   "the calls to worker2 and worker0 returned")
    finally:
        rpc.rpc_sync("worker1", gates.release, (key,))
    results = fut.wait()
    assert [(tag, host) for tag, host, _, _ in results] == list(enumerate(workers))
    ends = [end for _, _, _, end in results]
    assert ends != sorted(ends)  # answered out of order, returned in order
    assert call_all([]) == []


def test_calls_on_different_workers_run_at_the_same_time():
    # each call holds on a gate until all three run at once: calls made one after another would
    # never get there (the test fails at the hang guard, whatever the speed)
    key = "fanout-together"
    workers = ["worker1", "worker2", "worker0"]
    fut = call_all_async([(w, _held.timed, (100 + i, key)) for i, w in enumerate(workers)], timeout=HANG_S)
    assert isinstance(fut, torch.futures.Future)
    try:
        wait_until(lambda: all(rpc.rpc_sync(w, gates.holding, (key,)) for w in workers), "all three calls held at once")
    finally:
        for w in workers:
            rpc.rpc_sync(w, gates.release, (key,))
    results = fut.wait()
    starts = [start for _, _, start, _ in results]
    ends = [end for _, _, _, end in results]
    assert max(starts) < min(ends), (starts, ends)  # every call started before any ended


def test_first_failure_keeps_its_type_and_names_worker_and_index():
    calls = [("worker1", echo, (1,)), ("worker2", gates.fail, ("no table 7",)), ("worker1", echo, (2,))]
    for run in (lambda: call_all(calls), lambda: call_all_async(calls).wait()):
        with pytest.raises(UserError) as info:
            run()
        text = str(info.value)
        assert text.splitlines()[0] == "no table 7"
        assert "calls[1] of 3" in text and "worker2" in text and "tests._faults.gates.fail" in text
        assert "Remote traceback" in text


def test_first_failure_does_not_wait_for_the_other_calls():
    key = "fanout-first-failure"
    fut = call_all_async([("worker1", hold, (key,)), ("worker2", gates.fail, ("early",))], timeout=HANG_S)
    try:
        # (worker1's call reaches its gate at its own pace: wait for it, not for a race with worker2)
        wait_until(lambda: rpc.rpc_sync("worker1", gates.holding, (key,)), "worker1 holding its call")
        wait_until(fut.done, "the failure arrived")
        # the held call is still running on worker1 when the whole has already failed
        assert rpc.rpc_sync("worker1", gates.holding, (key,))
        with pytest.raises(UserError, match="early") as info:
            fut.wait()
        assert "calls[1] of 2" in str(info.value) and "worker2" in str(info.value)
    finally:
        rpc.rpc_sync("worker1", gates.release, (key,))


def test_a_call_that_hangs_times_out_naming_its_worker(unanswered_at_deadline):
    key = "fanout-timeout"
    workers = ["worker2", "worker1"]
    (kind, text), elapsed = held_outcome(lambda: call_all([("worker2", echo, (1,)), ("worker1", hold, (key,))],
                                                          timeout=SHORT), key)
    assert kind is CallTimeout, text
    assert_at_deadline(elapsed)
    unanswered = named_at_deadline(unanswered_at_deadline, workers)
    assert 1 in unanswered  # the held call (and calls[0] too, where a slow machine had not answered it yet)
    first = unanswered[0]
    assert f"calls[{first}] of 2" in text and repr(workers[first]) in text and "0.5 s" in text, text


def test_async_execution_handlers_are_answered_when_their_future_completes():
    assert call_all([("worker1", gates.add_later, (2, 3)), ("worker2", gates.add_later, (4, 5))]) == [5, 9]
    with pytest.raises(UserError, match="later") as info:
        call_all([("worker1", gates.add_later, (1, 1)), ("worker2", gates.fail_later, ("later",))])
    assert "calls[1] of 2" in str(info.value) and "worker2" in str(info.value)


def test_rrefs_made_on_the_hosts_come_back():
    rrefs = call_all([("worker1", gates.tensor_rref, (2,)), ("worker2", gates.tensor_rref, (3,))])
    assert [r.owner_name() for r in rrefs] == ["worker1", "worker2"]
    assert torch.equal(rrefs[1].to_here(), torch.full((3,), 3.0))


def test_system_exit_on_a_host_is_that_call_failure_and_the_host_keeps_serving():
    with pytest.raises(RemoteModuleError) as info:
        call_all([("worker1", gates.exit_now)])
    assert type(info.value).__name__ == "SystemExit" and "worker1" in str(info.value)
    assert call_all([("worker1", echo, ("still here",))]) == ["still here"]


def test_bad_calls_raise_before_anything_is_sent(monkeypatch):
    sent = []
    real = rpc.rpc_async
    monkeypatch.setattr(rpc, "rpc_async", lambda *a, **k: sent.append(a) or real(*a, **k))
    with pytest.raises(ValueError, match=r"calls\[1\] of 2 .*worker 'nobody' is not in this RPC world"):
        call_all([("worker1", echo, (1,)), ("nobody", echo, (2,))])
    with pytest.raises(TypeError, match=r"calls\[0\] must be a HostCall or a tuple"):
        call_all([echo])
    with pytest.raises(TypeError, match=r"calls\[0\]: args must be a tuple"):
        call_all([("worker1", echo, 5)])
    with pytest.raises(TypeError, match=r"calls\[0\]: the handler must be"):
        call_all([("worker1", "echo")])
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        call_all([("worker1", echo, (1,))], timeout=0)
    assert sent == []
    assert call_all([HostCall(1, echo, (), {"obj": "by rank, kwargs"})]) == ["by rank, kwargs"]


def test_an_argument_that_cannot_be_sent_names_the_call():
    with pytest.raises(
        TypeError, match=r"calls\[0\] of 1 \(tests\.proxy\._remote\.echo\) could not be sent to worker 'worker1'"
    ):
        call_all([("worker1", echo, (threading.Lock(),))])


def test_send_to_each_keeps_the_contract_of_call_all():
    # the entry point for calls a layer checked once: same order, failures and deadline
    infos = [rpc.get_worker_info(w) for w in ("worker2", "worker1", "worker2")]
    assert send_to_each(infos, echo, [("a",), ("b",), ("c",)], HANG_S).wait() == ["a", "b", "c"]
    assert send_to_each([], echo, [], HANG_S).wait() == []
    with pytest.raises(UserError) as info:
        send_to_each(infos[:2], gates.fail, [("first",), ("second",)], HANG_S).wait()
    text = str(info.value)  # whichever failure arrived first, named by its index and worker
    assert ("calls[0] of 2" in text and "worker2" in text and text.startswith("first")) or (
        "calls[1] of 2" in text and "worker1" in text and text.startswith("second")), text
    key = "send-to-each-timeout"
    try:  # both calls held: the first not answered is calls[0]
        (kind, text), elapsed = held_outcome(
            lambda: send_to_each(infos[:2], hold, [(key + "-2",), (key,)], SHORT).wait(), key)
        wait_until(lambda: rpc.rpc_sync("worker2", gates.holding, (key + "-2",)), "the call held on worker2")
    finally:
        rpc.rpc_sync("worker2", gates.release, (key + "-2",))
    assert kind is CallTimeout, text
    assert_at_deadline(elapsed)
    assert "calls[0] of 2" in text and "worker2" in text and "0.5 s" in text
    # and the other silent one: a call may wait on another host, so either may be the cause
    assert text.endswith("; also unanswered at the deadline: 1 call on 'worker1'"), text
    with pytest.raises(TypeError, match=r"calls\[0\] of 1 .*could not be sent to worker 'worker1'"):
        send_to_each([rpc.get_worker_info("worker1")], echo, [(threading.Lock(),)], HANG_S)


def _outcome(run):
    """What ``run()`` gave: ("ok", result) or (exception type, its message without the remote
    traceback)."""
    try:
        return "ok", run()
    except BaseException as exc:  # noqa: BLE001 - compared below
        return type(exc), str(exc).split("Remote traceback")[0]


def test_call_one_keeps_the_contract_of_call_all_for_one_call():
    # waited for in the calling thread, with RPC's own deadline: every outcome as call_all's
    cases = [
        ("worker1", echo, ("x",)),
        ("worker2", gates.fail, ("no table 7",)),  # the handler's own error, its type kept
        ("worker1", gates.add_later, (2, 3)),  # async_execution
        ("worker2", gates.fail_later, ("later",)),
        ("worker1", gates.exit_now),  # SystemExit on the host: that call's failure
        ("nobody", echo, (1,)),  # refused before sending
        ("worker1", echo, (threading.Lock(),)),  # cannot be sent
        HostCall(1, echo, (), {"obj": "by rank, kwargs"}),
    ]
    for call in cases:
        one = _outcome(lambda: call_one(call, timeout=HANG_S))
        alone = _outcome(lambda: call_all([call], timeout=HANG_S)[0])
        assert one == alone, (call, one, alone)
    assert _outcome(lambda: call_one(("worker1", echo, (1,)), timeout=0)) == _outcome(
        lambda: call_all([("worker1", echo, (1,))], timeout=0))
    timed_out = []
    for key, run in (("call-one-timeout", lambda k: call_one(("worker1", hold, (k,)), timeout=SHORT)),
                     ("call-all-timeout", lambda k: call_all([("worker1", hold, (k,))], timeout=SHORT))):
        outcome, elapsed = held_outcome(lambda: run(key), key)
        assert_at_deadline(elapsed)
        timed_out.append(outcome)
    assert timed_out[0] == timed_out[1]
    kind, text = timed_out[0]
    assert kind is CallTimeout and "calls[0] of 1" in text and "'worker1'" in text and "0.5 s" in text
    assert call_one(("worker2", echo, ("after a timeout",))) == "after a timeout"


def test_call_grouped_sends_one_message_per_worker_and_keeps_the_contract(monkeypatch, unanswered_at_deadline):
    sent = []
    real = rpc.rpc_async
    monkeypatch.setattr(rpc, "rpc_async", lambda to, *a, **k: sent.append(to.name) or real(to, *a, **k))
    calls = [("worker1", echo, ("a",)), ("worker2", echo, ("b",)), ("worker1", gates.add_later, (2, 3)),
             ("worker1", echo, ("c",)), ("worker2", gates.add_later, (4, 5))]
    assert call_grouped(calls, timeout=HANG_S) == ["a", "b", 5, "c", 9]
    assert sorted(sent) == ["worker1", "worker2"]  # one message each
    assert call_grouped([]) == []
    # a failure inside a shared message is that call's, with its type, index and worker
    with pytest.raises(UserError) as info:
        call_grouped([("worker1", echo, (1,)), ("worker2", echo, (2,)), ("worker1", gates.fail, ("third",))])
    text = str(info.value)
    assert text.startswith("third") and "calls[2] of 3" in text and "worker1" in text
    with pytest.raises(UserError, match="later") as info:
        call_grouped([("worker2", echo, (1,)), ("worker2", gates.fail_later, ("later",))])
    assert "calls[1] of 2" in str(info.value) and "worker2" in str(info.value)
    # the worker keeps serving, and the order within a message is the order given
    key = "grouped-timeout"
    workers = ["worker2", "worker1", "worker1"]
    (kind, text), elapsed = held_outcome(
        lambda: call_grouped([("worker2", echo, (1,)), ("worker1", hold, (key,)), ("worker1", echo, (3,))],
                             timeout=SHORT), key)
    assert kind is CallTimeout, text
    assert_at_deadline(elapsed)
    unanswered = named_at_deadline(unanswered_at_deadline, workers)
    assert 1 in unanswered and 2 in unanswered  # worker1's message: held
    first = unanswered[0]  # calls[1], unless a slow machine left worker2's message unanswered too
    assert f"calls[{first}] of 3" in text and repr(workers[first]) in text, text
    assert call_grouped([("worker1", echo, ("still",)), ("worker1", echo, ("here",))]) == ["still", "here"]


def test_call_grouped_each_gives_every_calls_outcome_and_names_a_shared_failure():
    key = "grouped-each"
    (kind, outcomes), elapsed = held_outcome(
        lambda: call_grouped_each([("worker1", echo, ("a",)), ("worker2", gates.fail, ("no",)),
                                   ("worker2", echo, ("b",)), ("worker1", hold, (key,))], timeout=SHORT), key)
    assert kind == "ok", outcomes
    assert_at_deadline(elapsed)  # the outcomes come once worker1's message timed out
    # worker1's message (held): both of its calls timed out, each named
    late = [v for ok, v in (outcomes[0], outcomes[3])]
    assert [ok for ok, _ in (outcomes[0], outcomes[3])] == [False, False]
    assert all(isinstance(v, CallTimeout) for v in late) and "calls[3] of 4" in str(late[1])
    if isinstance(outcomes[2][1], CallTimeout):  # a slow machine: worker2 had not answered at the deadline
        assert [ok for ok, _ in outcomes[1:3]] == [False, False], outcomes
        assert isinstance(outcomes[1][1], CallTimeout) and "calls[1] of 4" in str(outcomes[1][1])
        assert "calls[2] of 4" in str(outcomes[2][1])
    else:  # worker2's message was answered in time: each of its calls' own outcome
        assert [ok for ok, _ in outcomes[1:3]] == [False, True] and outcomes[2][1] == "b", outcomes
        assert isinstance(outcomes[1][1], UserError) and "calls[1] of 4" in str(outcomes[1][1])
    # an answer that cannot be pickled fails the message: every call in it is named
    with pytest.raises(Exception) as info:
        call_grouped([("worker1", echo, (1,)), ("worker1", gates.unpicklable_result)], timeout=HANG_S)
    text = str(info.value)
    assert "calls[0] of 2" in text and "calls[1] of 2" in text and "one message" in text
    assert call_grouped([("worker1", echo, ("fine",))]) == ["fine"]



def test_a_batch_timeout_names_each_silent_worker_once():
    names = ["w0"] * 20 + ["w1"] * 20 + ["w2"]
    assert answers.calls_by_worker(names) == "20 calls on 'w0', 20 on 'w1', 1 on 'w2'"
    many = [f"w{i}" for i in range(12)]
    assert answers.calls_by_worker(many) == ("1 call on 'w0', 1 on 'w1', 1 on 'w2', 1 on 'w3', 1 on 'w4', "
                                             "1 on 'w5', 1 on 'w6', 1 on 'w7' and 4 other workers")
