"""Settling futures in runs (remote_module._core.settling), without RPC: a callback that blocks
holds up no other future for more than a moment, one that raises stops nothing, a future
settled twice is logged, and the watcher calls targets at their deadlines."""

import logging
import threading
import time

import pytest
from torch.futures import Future

from remote_module._core import settling as _settling
from remote_module._core.settling import (
    complete,
    finish_run,
    schedule,
    settle_elsewhere,
    settle_here,
    watched_run,
)
from tests._deadlines import HANG_S


def wait_for(predicate, seconds: float = HANG_S) -> bool:
    """Poll ``predicate``; False when ``seconds`` passed first (a hang guard)."""
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def futures_with_blockers(count: int, blocked: set[int], release: threading.Event, returned: list):
    """``count`` futures; those in ``blocked`` get a callback that waits for ``release`` (HANG_S
    at most), then appends its index to ``returned``."""
    futures = [Future() for _ in range(count)]

    def block(i):
        release.wait(HANG_S)
        returned.append(i)

    for i in blocked:
        futures[i].add_done_callback(lambda _, i=i: block(i))
    return futures


@pytest.mark.parametrize("where", ["here", "elsewhere"])
def test_blocked_callbacks_hold_up_the_rest_of_a_run_only_briefly(where):
    # Briefly, at any speed: every other future of the run is settled while the blocked
    # callbacks are still blocked (they are let go only afterwards), so none waited for them.
    # (About STUCK_S plus a watcher tick per blocked callback on an idle machine.)
    release, returned = threading.Event(), []
    blocked = {0, 1, 2, 3, 10}
    futures = futures_with_blockers(200, blocked, release, returned)
    jobs = [lambda f=f, i=i: complete(f, i, False) for i, f in enumerate(futures)]
    try:
        if where == "here":  # a thread that settles a message's futures (an RPC thread)
            threading.Thread(target=settle_here, args=(jobs,), daemon=True).start()
        else:
            settle_elsewhere(jobs)
        others = [f for i, f in enumerate(futures) if i not in blocked]
        assert wait_for(lambda: all(f.done() for f in others)), (
            f"hang guard: {sum(not f.done() for f in others)} futures still unsettled after {HANG_S} s"
        )
        assert returned == [], "a blocked callback returned before the other futures were settled"
        assert [f.wait() for f in others] == [i for i in range(200) if i not in blocked]
    finally:
        release.set()
    assert wait_for(lambda: all(f.done() for f in futures)), "hang guard: the blocked futures never settled"
    assert wait_for(lambda: sorted(returned) == sorted(blocked)), "hang guard: the blocked callbacks never returned"


def test_a_watched_run_settles_elsewhere_while_its_thread_is_held_up():
    # e.g. an RPC thread sending the next message, when torch runs a callback inline
    futures = [Future() for _ in range(3)]
    release, let_go = threading.Event(), []

    def answer_then_get_held_up():
        run = watched_run([lambda f=f: complete(f, "answer", False) for f in futures])
        release.wait(HANG_S)
        let_go.append(True)
        finish_run(run)

    threading.Thread(target=answer_then_get_held_up, daemon=True).start()
    try:
        assert wait_for(lambda: all(f.done() for f in futures)), "hang guard: the run was never settled"
        assert let_go == [], "settled only once its thread was let go"
        assert [f.wait() for f in futures] == ["answer"] * 3
    finally:
        release.set()


def test_a_run_without_blocked_callbacks_settles_in_order_on_the_calling_thread():
    seen = []
    futures = [Future() for _ in range(50)]
    for i, f in enumerate(futures):
        f.add_done_callback(lambda _, i=i: seen.append((i, threading.get_ident())))
    settle_here([lambda f=f, i=i: complete(f, i, False) for i, f in enumerate(futures)])
    assert seen == [(i, threading.get_ident()) for i in range(50)]


def test_a_callback_that_raises_stops_nothing():
    futures = [Future() for _ in range(3)]

    def bad(_):
        raise ValueError("callback bug")  # torch reports it on stderr

    futures[0].add_done_callback(bad)
    settle_here([lambda f=f: complete(f, RuntimeError("failed call"), True) for f in futures])
    assert all(f.done() for f in futures)
    with pytest.raises(RuntimeError, match="failed call"):
        futures[2].wait()


def test_settling_a_future_twice_is_logged_not_raised(caplog):
    future = Future()
    complete(future, 1, False)
    with caplog.at_level(logging.ERROR, logger="remote_module"):
        complete(future, 2, False)
    assert future.wait() == 1
    assert "settling a remote call's future failed" in caplog.text


def test_the_watcher_calls_a_target_at_its_deadline():
    class Target:
        def __init__(self):
            self.called = []

        def expire(self, now):
            self.called.append(now)

    # at its deadline: never before it (the watcher's own clock reading), once; how soon after
    # depends on the machine (WATCH_TICK_S on an idle one), so the only upper bound is the hang guard
    target, later = Target(), Target()
    when = time.monotonic() + 0.2
    schedule(when + 0.2, later)
    schedule(when, target)
    assert wait_for(lambda: target.called and later.called), "hang guard: a target was never called"
    assert target.called[0] >= when and later.called[0] >= when + 0.2, (when, target.called, later.called)
    assert target.called[0] <= later.called[0]  # in the order of their deadlines
    assert len(target.called) == 1 and len(later.called) == 1
    assert _settling._watcher._thread is not None and _settling._watcher._thread.daemon
