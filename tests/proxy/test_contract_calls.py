"""The calls contract (README, "Calls") on the shared world: every call path, the coalesced
one included, keeps the behaviour of one call per message: program order at blocking calls,
a timeout per call, each call succeeding or failing alone, no callback able to stall a
proxy. (Frozen hosts and shutdown: tests/proxy/test_contract_faults.py.)"""

import threading
import time

import pytest
import torch
import torch.distributed.rpc as rpc
from torch import nn

from remote_module import RemoteModule
from remote_module._core.errors import CallTimeout, RemoteModuleError
from remote_module._core.settling import WATCH_TICK_S
from remote_module._proxy.channel import MAX_IN_FLIGHT
from tests._deadlines import HANG_S
from tests._faults import gates
from tests._marks import GRAD_ON_WITHOUT_CONTEXT
from tests.proxy import _contract_remote as cr
from tests.proxy import _held

pytestmark = [pytest.mark.usefixtures("rpc_world"), GRAD_ON_WITHOUT_CONTEXT]


def warm(proxy, *args):
    """One answered call: the proxy's channel then knows the call's cost and coalesces."""
    proxy.forward_async(*args).wait()
    assert proxy._channel.cost is not None
    channel = proxy._channel
    assert channel.cost is not None
    with channel.lock:  # a host thread preempted under load can report a cheap call as heavy
        # (> HEAVY_CALL_S: a message each, rightly); these tests are about cheap calls
        channel.cost = min(channel.cost, 0.0)
    return channel


def in_thread(fn, seconds=HANG_S):
    """Run ``fn`` in a daemon thread; its result, or fail the test when it takes longer (a
    hang guard)."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # reported below
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"hang guard: still running after {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


# ---- 4. no callback can stall a proxy --------------------------------------------------------


def hooked_while_held(proxy, worker, key, hooks):
    """Two calls whose host holds them on ``key`` until each got its ``hooks`` (a list, one
    per call, each called with the call's future), then lets them go: their answers arrive
    only once the callbacks are in place, so these run where the answers are settled (an RPC
    thread), never at once in this thread, however slow the machine."""
    futs = [proxy.forward_async(key) for _ in hooks]
    try:
        assert not any(f.done() for f in futs), "answered although its host held it"
        for fut, hook in zip(futs, hooks):
            hook(fut)
    finally:
        rpc.rpc_sync(worker, gates.release, (key,))
    return futs


@pytest.mark.parametrize("hook", ["then", "add_done_callback"])
def test_a_callback_waiting_on_the_same_proxy_completes(hook):
    proxy = RemoteModule("worker1", _held.Held, timeout=HANG_S)
    warm(proxy, "free")

    def scenario():
        inner = []

        def callback(fut):
            inner.append(proxy.forward_async(f"after {fut.wait()}").wait())  # blocks this callback

        hooks = [lambda fut: getattr(fut, hook)(callback)] * 2
        hooked_while_held(proxy, "worker1", f"hold-callback-{hook}", hooks)
        _held.wait_until(lambda: len(inner) >= 2, "both callbacks' calls returned")
        return inner

    assert in_thread(scenario, 2 * HANG_S) == [f"after hold-callback-{hook}"] * 2


def test_a_callback_blocked_forever_does_not_stall_later_calls():
    proxy = RemoteModule("worker1", _held.Held, timeout=HANG_S)
    warm(proxy, "free")
    release = threading.Event()
    blocking, unblocked = [], []

    def block(_):  # blocks an RPC thread until the later calls' results are in
        blocking.append(True)
        release.wait(HANG_S)
        unblocked.append(True)

    try:
        hooked_while_held(proxy, "worker1", "hold-blocked-callbacks", [lambda fut: fut.add_done_callback(block)] * 2)
        _held.wait_until(lambda: len(blocking) == 2, "both callbacks blocking")
        later = [proxy.forward_async(f"free-{i}") for i in range(64)]
        results = in_thread(lambda: [f.wait() for f in later])
        assert results == [f"free-{i}" for i in range(64)]
        assert unblocked == [], "the blocking callbacks returned before the later calls were answered"
    finally:
        release.set()


# ---- 2. coalescing never turns a call that would succeed into a timeout ----------------------


#: calls of a burst that must be inside the host's forward at once (tests/proxy/_held.py, Crowd):
#: calls sharing a message would run there one after another and never get there
CROWD = 8


def outcomes_of(futs):
    outcomes = []
    for f in futs:
        try:
            outcomes.append(f.wait())
        except Exception as exc:
            outcomes.append(f"{type(exc).__name__}: {exc}")
    return outcomes


def test_slow_calls_in_a_burst_all_succeed_within_their_timeout():
    # Slow calls (0.1 s each on the host) get a message each and run side by side there; made
    # to share messages, 64 of them would take 6.4 s, past a timeout that one of them keeps
    # easily. Shown by what holds at any speed: every call waits until CROWD of them are
    # inside the host's forward at once, and none shared a message.
    proxy = RemoteModule("worker2", _held.Crowd, timeout=HANG_S)
    futs = [proxy.forward_async(0.1, CROWD) for _ in range(64)]
    assert outcomes_of(futs) == [0.1] * 64
    assert proxy._channel.shared_messages == 0 and proxy._channel.messages_sent == 64
    assert proxy.get_module_rref().rpc_sync().most_inside() >= CROWD


def test_calls_that_become_slow_after_cheap_ones_still_succeed():
    proxy = RemoteModule("worker2", _held.Crowd, timeout=HANG_S)
    warm(proxy, 0.0)
    # The channel counts these calls cheap: the first MAX_IN_FLIGHT leave at once (they may
    # not wait for a crowd: the rest queue until one is answered); the first answer shows them
    # slow, and the rest then leave one message each, to run side by side on the host.
    futs = [proxy.forward_async(0.1, 0 if i < MAX_IN_FLIGHT else CROWD) for i in range(48)]
    assert outcomes_of(futs) == [0.1] * 48
    assert proxy._channel.shared_messages == 0
    assert proxy.get_module_rref().rpc_sync().most_inside() >= CROWD


def test_the_first_calls_are_not_coalesced_until_their_cost_is_known():
    proxy = RemoteModule("worker2", cr.Slow, timeout=HANG_S)
    futs = [proxy.forward_async(0.05) for _ in range(8)]
    assert [f.wait() for f in futs] == [0.05] * 8
    assert proxy._channel.shared_messages == 0 and proxy._channel.messages_sent == 8


def test_a_timeout_says_the_call_was_sent():
    # the host holds each call until its timeout error is in (tests/proxy/_held.py)
    proxy = RemoteModule("worker2", _held.Held, timeout=HANG_S)
    proxy.timeout = 1
    for i, call in enumerate((lambda key: proxy.forward_async(key).wait(), proxy)):
        error = _held.fails_while_held(call, f"hold-sent-{i}", CallTimeout, 1, worker="worker2")
        assert "sent to worker 'worker2', no answer within 1 s" in str(error), error


def test_a_blocking_call_queued_behind_slow_ones_times_out_unsent():
    proxy = RemoteModule("worker2", _held.Held, timeout=HANG_S)
    key = "hold-queued-behind"
    pending = proxy.forward_async(key)  # held on its host until the blocking call failed
    proxy.timeout = 1  # later calls get less time than the one still running
    try:
        start = time.monotonic()
        with pytest.raises(CallTimeout, match="timed out after 1 s before it was sent"):
            proxy("free")
        elapsed = time.monotonic() - start
        assert not pending.done(), "the call it queued behind was answered before it failed"
    finally:
        rpc.rpc_sync("worker2", gates.release, (key,))
    assert 1 - WATCH_TICK_S <= elapsed < 1 + HANG_S, f"failed after {elapsed:.3f} s (hang guard: {HANG_S} s)"
    assert pending.wait() == key


# ---- 3. each call succeeds or fails alone ----------------------------------------------------


@pytest.mark.parametrize("bad", ["unpicklable", "exit", "interrupt"])
def test_one_bad_call_in_a_burst_fails_alone(bad):
    proxy = RemoteModule("worker1", cr.Picky, timeout=HANG_S)
    warm(proxy, 1)
    inputs = [bad if i % 16 == 5 else i for i in range(64)]
    futs = [proxy.forward_async(x) for x in inputs]
    torch.futures.wait_all([f.then(lambda f: None) for f in futs])
    assert proxy._channel.shared_messages > 0  # the burst did share messages
    for x, fut in zip(inputs, futs):
        if x != bad:
            assert fut.wait() == x + 1
            continue
        with pytest.raises(Exception) as info:
            fut.wait()
        if bad == "unpicklable":
            assert isinstance(info.value, TypeError) and "pickle" in str(info.value)
        else:  # SystemExit / KeyboardInterrupt on the host must not stop the caller
            assert isinstance(info.value, RemoteModuleError)
            assert type(info.value).__name__ == {"exit": "SystemExit", "interrupt": "KeyboardInterrupt"}[bad]
    assert proxy(1) == 2


# ---- 1. program order at synchronisation points ---------------------------------------------


def test_a_blocking_forward_runs_after_earlier_async_calls():
    proxy = RemoteModule("worker1", cr.Counter)
    warm(proxy)
    for round_ in range(5):
        futs = [proxy.forward_async() for _ in range(64)]
        position = proxy()
        assert position == 65 * (round_ + 1) + 1, position  # after all 64 of this round
        torch.futures.wait_all(futs)


def test_forward_async_made_before_eval_runs_in_training_mode():
    proxy = RemoteModule("worker1", cr.Mode)
    warm(proxy)
    for _ in range(3):
        proxy.train()
        futs = [proxy.forward_async() for _ in range(30)]
        proxy.eval()
        assert [f.wait() for f in futs] == [True] * 30
        assert proxy() is False


def test_state_dict_sees_every_earlier_async_call():
    proxy = RemoteModule("worker1", nn.BatchNorm1d, (3,))
    warm(proxy, torch.randn(4, 3))
    futs = [proxy.forward_async(torch.randn(4, 3)) for _ in range(40)]
    assert proxy.state_dict()["num_batches_tracked"].item() == 41
    torch.futures.wait_all(futs)


def test_calls_that_share_a_message_run_in_the_order_made():
    proxy = RemoteModule("worker2", cr.Log)
    warm(proxy, "warm")
    futs = [proxy.forward_async(i) for i in range(100)]
    torch.futures.wait_all(futs)
    assert proxy._channel.shared_messages > 0
    log = proxy(None)
    assert log[0] == "warm" and sorted(log[1:]) == list(range(100))
    # messages may run concurrently, calls inside one never out of order: a shared message is
    # a contiguous run, so every run of consecutive entries that is out of order is short
    inversions = sum(1 for a, b in zip(log[1:], log[2:]) if b < a)
    assert inversions <= proxy._channel.messages_sent


def test_other_threads_are_not_serialised():
    # Program order is per thread: another thread's blocking call need not wait. The first call
    # holds on a gate until the other thread's call came back (whatever the machine's speed).
    proxy = RemoteModule("worker2", _held.Held, timeout=HANG_S)
    key = "hold-other-threads"
    held = proxy.forward_async(key)
    try:
        assert in_thread(lambda: proxy("free")) == "free"
        assert not held.done(), "the first call returned before its gate was released"
    finally:
        rpc.rpc_sync("worker2", gates.release, (key,))
    assert held.wait() == key


# ---- 7. what arrives is what was sent ---------------------------------------------------------


def _fidelity_cases():
    import collections

    looped: list = [1]
    looped.append(looped)  # a list that contains itself
    base = torch.arange(12.0).reshape(3, 4)
    big = torch.arange(4096.0)  # 16 KB storage: RPC sends some views of it as compact copies
    same = torch.ones(3)
    return {
        "defaultdict": collections.defaultdict(list, {"a": [1], "b": []}),
        "list subclass": cr.ListSubclass([1, [2, 3]]),
        "self-reference": looped,
        "channels_last": torch.randn(1, 3, 2, 2).to(memory_format=torch.channels_last),
        "transpose": torch.randn(3, 4).t(),
        "a tensor and its view": [base, base[1], base[:, ::2]],
        "the same tensor twice": {"x": same, "y": same},
        "small view of a big storage": big[:2048],
        "larger view of a big storage": big[:2049],
        "views sharing a big storage": (big[:100], big[3000:]),
        "requires_grad": torch.randn(2, requires_grad=True),
    }


@pytest.mark.parametrize("path", ["inline", "tensor channel"])
@pytest.mark.parametrize("name", list(_fidelity_cases()))
def test_arguments_arrive_as_plain_rpc_delivers_them(name, path):
    # The reference is torch's own RPC: the same value sent with rpc_sync to a plain function.
    # Through the proxy it travels inlined (no dist autograd context) or, inside one, through
    # RPC's tensor channel; what the host sees must be the same either way.
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc

    value = _fidelity_cases()[name]
    proxy = RemoteModule("worker1", cr.Describe)
    expected = rpc.rpc_sync("worker1", cr.describe, (value,))
    if path == "inline":
        got = proxy(value)
    else:
        with dist_autograd.context():
            got = proxy(value)
    assert got == expected
