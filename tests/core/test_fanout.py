"""remote_module._core.fanout: N host calls at once, results in order, the first failure naming its
worker and index, a timeout per call."""

import threading
import time

import pytest
import torch
import torch.distributed.rpc as rpc

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
from tests._faults import gates
from tests.proxy._remote import UserError, echo

pytestmark = pytest.mark.usefixtures("rpc_world")


def wait_until(predicate, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_results_come_back_in_the_order_of_the_calls():
    # the first call is held (on a gate) until the calls to worker2 and worker0 returned, so the
    # hosts answer out of order whatever the machine's speed
    key = "fanout-order"
    workers = ["worker1", "worker2", "worker0", "worker1"]
    calls = [HostCall(w, gates.timed, (i, 0.0, key if i == 0 else None)) for i, w in enumerate(workers)]
    fut = call_all_async(calls, timeout=60)
    try:
        wait_until(lambda: all(rpc.rpc_sync(workers[i], gates.finished, ([i],)) == [i] for i in (1, 2)), 30)
    finally:
        rpc.rpc_sync("worker1", gates.release, (key,))
    results = fut.wait()
    assert [(tag, host) for tag, host, _, _ in results] == list(enumerate(workers))
    ends = [end for _, _, _, end in results]
    assert ends != sorted(ends)  # answered out of order, returned in order
    assert call_all([]) == []


def test_calls_on_different_workers_run_at_the_same_time():
    # each call holds on a gate until all three run at once: calls made one after another would
    # never get there (the test fails at the deadline, whatever the speed)
    key = "fanout-together"
    workers = ["worker1", "worker2", "worker0"]
    fut = call_all_async([(w, gates.timed, (100 + i, 0.0, key)) for i, w in enumerate(workers)], timeout=60)
    assert isinstance(fut, torch.futures.Future)
    try:
        wait_until(lambda: all(rpc.rpc_sync(w, gates.holding, (key,)) for w in workers), 30)
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
    fut = call_all_async([("worker1", gates.hold, (key,)), ("worker2", gates.fail, ("early",))], timeout=20)
    try:
        wait_until(fut.done)
        # the held call is still running on worker1 when the whole has already failed
        assert rpc.rpc_sync("worker1", gates.holding, (key,))
        with pytest.raises(UserError, match="early") as info:
            fut.wait()
        assert "calls[1] of 2" in str(info.value) and "worker2" in str(info.value)
    finally:
        rpc.rpc_sync("worker1", gates.release, (key,))


def test_a_call_that_hangs_times_out_naming_its_worker():
    key = "fanout-timeout"
    start = time.monotonic()
    try:
        with pytest.raises(CallTimeout) as info:
            call_all([("worker2", echo, (1,)), ("worker1", gates.hold, (key,))], timeout=0.5)
        elapsed = time.monotonic() - start
    finally:
        rpc.rpc_sync("worker1", gates.release, (key,))
    assert elapsed < 0.5 + 2.0
    text = str(info.value)
    assert "calls[1] of 2" in text and "worker1" in text and "0.5 s" in text


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
    assert send_to_each(infos, echo, [("a",), ("b",), ("c",)], 10.0).wait() == ["a", "b", "c"]
    assert send_to_each([], echo, [], 10.0).wait() == []
    with pytest.raises(UserError) as info:
        send_to_each(infos[:2], gates.fail, [("first",), ("second",)], 10.0).wait()
    text = str(info.value)  # whichever failure arrived first, named by its index and worker
    assert ("calls[0] of 2" in text and "worker2" in text and text.startswith("first")) or (
        "calls[1] of 2" in text and "worker1" in text and text.startswith("second")), text
    key = "send-to-each-timeout"
    start = time.monotonic()
    try:
        with pytest.raises(CallTimeout) as timed_out:
            send_to_each(infos[:2], gates.hold, [(key + "-2",), (key,)], 0.5).wait()
        elapsed = time.monotonic() - start
    finally:
        rpc.rpc_sync("worker1", gates.release, (key,))
        rpc.rpc_sync("worker2", gates.release, (key + "-2",))
    assert elapsed < 0.5 + 2.0
    text = str(timed_out.value)
    assert "calls[0] of 2" in text and "worker2" in text and "0.5 s" in text
    with pytest.raises(TypeError, match=r"calls\[0\] of 1 .*could not be sent to worker 'worker1'"):
        send_to_each([rpc.get_worker_info("worker1")], echo, [(threading.Lock(),)], 10.0)


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
        one, alone = _outcome(lambda: call_one(call, timeout=10)), _outcome(lambda: call_all([call], timeout=10)[0])
        assert one == alone, (call, one, alone)
    assert _outcome(lambda: call_one(("worker1", echo, (1,)), timeout=0)) == _outcome(
        lambda: call_all([("worker1", echo, (1,))], timeout=0))
    timed_out = []
    for key, run in (("call-one-timeout", lambda k: call_one(("worker1", gates.hold, (k,)), timeout=0.5)),
                     ("call-all-timeout", lambda k: call_all([("worker1", gates.hold, (k,))], timeout=0.5))):
        start = time.monotonic()
        try:
            timed_out.append(_outcome(lambda: run(key)))
            elapsed = time.monotonic() - start
        finally:
            rpc.rpc_sync("worker1", gates.release, (key,))
        assert elapsed < 0.5 + 2.0
    assert timed_out[0] == timed_out[1]
    kind, text = timed_out[0]
    assert kind is CallTimeout and "calls[0] of 1" in text and "'worker1'" in text and "0.5 s" in text
    assert call_one(("worker2", echo, ("after a timeout",))) == "after a timeout"


def test_call_grouped_sends_one_message_per_worker_and_keeps_the_contract(monkeypatch):
    sent = []
    real = rpc.rpc_async
    monkeypatch.setattr(rpc, "rpc_async", lambda to, *a, **k: sent.append(to.name) or real(to, *a, **k))
    calls = [("worker1", echo, ("a",)), ("worker2", echo, ("b",)), ("worker1", gates.add_later, (2, 3)),
             ("worker1", echo, ("c",)), ("worker2", gates.add_later, (4, 5))]
    assert call_grouped(calls, timeout=10) == ["a", "b", 5, "c", 9]
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
    start = time.monotonic()
    try:
        with pytest.raises(CallTimeout) as timed_out:
            call_grouped([("worker2", echo, (1,)), ("worker1", gates.hold, (key,)), ("worker1", echo, (3,))],
                         timeout=0.5)
        elapsed = time.monotonic() - start
    finally:
        rpc.rpc_sync("worker1", gates.release, (key,))
    assert elapsed < 0.5 + 2.0
    assert "calls[1] of 3" in str(timed_out.value) and "worker1" in str(timed_out.value)
    assert call_grouped([("worker1", echo, ("still",)), ("worker1", echo, ("here",))]) == ["still", "here"]


def test_call_grouped_each_gives_every_calls_outcome_and_names_a_shared_failure():
    key = "grouped-each"
    try:
        outcomes = call_grouped_each([("worker1", echo, ("a",)), ("worker2", gates.fail, ("no",)),
                                      ("worker2", echo, ("b",)), ("worker1", gates.hold, (key,))], timeout=0.5)
    finally:
        rpc.rpc_sync("worker1", gates.release, (key,))
    assert [ok for ok, _ in outcomes] == [False, False, True, False]  # worker1's message: answered late
    assert outcomes[2][1] == "b"
    assert isinstance(outcomes[1][1], UserError) and "calls[1] of 4" in str(outcomes[1][1])
    late = [v for ok, v in (outcomes[0], outcomes[3])]
    assert all(isinstance(v, CallTimeout) for v in late) and "calls[3] of 4" in str(late[1])
    # an answer that cannot be pickled fails the message: every call in it is named
    with pytest.raises(Exception) as info:
        call_grouped([("worker1", echo, (1,)), ("worker1", gates.unpicklable_result)], timeout=10)
    text = str(info.value)
    assert "calls[0] of 2" in text and "calls[1] of 2" in text and "one message" in text
    assert call_grouped([("worker1", echo, ("fine",))]) == ["fine"]

