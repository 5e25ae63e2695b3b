"""The heartbeats of rpc_backend/watch.py: who is lost when, what is said, what follows.

The decision (:class:`Peers`) and the watcher's reactions (:class:`Watcher` with a fake send
and a fake clock) are tested without RPC or threads; tests/backend/test_watch_worlds.py runs
them in local worlds, tests/test_lost_machines.py across simulated machines.
"""

from __future__ import annotations

import gc
import math
import threading

import pytest

from rpc_backend import placements
from rpc_backend import watch as w
from rpc_backend.watch import (
    LEAVING,
    RUNNING,
    Beat,
    LostWorker,
    Origin,
    Peers,
    Watcher,
    WatchSettings,
    WorkerLost,
    describe_lost,
    watch_settings,
)

HB, AFTER = 1.0, 10.0
SETTINGS = WatchSettings(HB, AFTER, frozenset())
LAYOUT = placements(4, {"ps": 1, "trainer": 2, "replica": 1})  # ps0 trainer0 trainer1 replica0
M0 = Origin("machine0", "10.42.0.1", "0", 100)
M1 = Origin("machine1", "10.42.0.2", "1", 200)


def beat(name: str, origin: Origin = M1, phase: str = RUNNING, status: str = "") -> Beat:
    return Beat(name, phase, status, origin)


def peers(me: str = "ps0", settings: WatchSettings = SETTINGS, start: float = 0.0) -> Peers:
    return Peers(me, LAYOUT, settings, start)


# ---- who is lost, and when ----------------------------------------------------------------

def test_a_peer_is_lost_after_lost_after_seconds_of_silence_not_before():
    p = peers()
    for name in ("trainer0", "trainer1", "replica0"):
        p.heard(name, beat(name), 5.0)
    assert p.check(14.999) == ([], [])
    fatal, spared = p.check(15.0)
    assert [x.name for x in fatal] == ["trainer0", "trainer1", "replica0"] and spared == []
    assert all(x.silent_s == 10.0 for x in fatal)
    assert p.check(30.0) == ([], [])  # each is named once


def test_hearing_from_a_peer_or_its_answer_keeps_it_alive():
    p = peers()
    p.heard("trainer0", beat("trainer0"), 8.0)  # its heartbeat arrived
    for name in p.due(9.0):
        p.answered(name, beat(name), True, RUNNING, 9.5)  # every peer answered ours
    fatal, _ = p.check(18.0)
    assert fatal == []
    fatal, _ = p.check(19.5)
    assert {x.name for x in fatal} == {"trainer0", "trainer1", "replica0"}


def test_what_waits_in_this_ranks_own_queue_is_not_silence():
    # probing: silence counts only up to what this rank's RPC queue has handled
    p = Peers("ps0", LAYOUT, SETTINGS, 0.0, probing=True)
    for name in ("trainer0", "trainer1", "replica0"):
        p.heard(name, beat(name), 5.0)
    assert p.probe_due(5.0) and not p.probe_due(6.0)  # one in flight at a time
    p.probed(True, 5.1)
    assert p.heard_until(6.0) == 6.0  # keeping up: up to now
    assert p.probe_due(6.0)  # and this one waits behind a backlog (or the process froze)
    assert p.heard_until(30.0) == 5.0 and p.check(30.0) == ([], [])  # nobody blamed
    p.probed(True, 40.0)  # handled at last: everything sent before 6.0 was read
    assert p.heard_until(40.0) == 6.0 and p.check(40.0) == ([], [])
    assert p.probe_due(40.0)
    p.probed(True, 40.1)  # caught up: the peers' heartbeats would have been read by now
    fatal, _ = p.check(40.2)
    assert [x.name for x in fatal] == ["trainer0", "trainer1", "replica0"]
    assert all(x.silent_s == pytest.approx(35.2) for x in fatal)


def test_heartbeats_go_on_while_their_answers_wait_in_this_ranks_queue():
    # a rank behind a backlog keeps telling its peers it is alive: the answers to its earlier
    # heartbeats need not have been handled, up to lost_after / heartbeat of them in flight
    p = Peers("ps0", LAYOUT, SETTINGS, 0.0, probing=True)
    most = w.LATE_READ_FACTOR * int(AFTER / HB) + 1  # (as long as its own silence would not count)
    sent = [p.due(float(t)) for t in range(most + 2)]
    assert sent[:most] == [["trainer0", "trainer1", "replica0"]] * most and sent[most:] == [[], []]
    p.answered("trainer0", beat("trainer0"), True, RUNNING, most + 2.0)
    assert p.due(most + 2.0) == ["trainer0"]
    assert _one_in_flight_without_probing()  # (Peers without the watcher's probe: one at a time)


def _one_in_flight_without_probing() -> bool:
    p = peers()
    p.due(0.0)
    return p.due(5.0) == []


def test_silence_read_late_counts_anyway_after_a_bound():
    # a rank whose RPC threads are all blocked (on the lost peer, say) never reads its probe:
    # its peers' silence counts anyway once it is LATE_READ_FACTOR * lost_after old
    p = Peers("ps0", LAYOUT, SETTINGS, 0.0, probing=True)
    for name in ("trainer0", "trainer1", "replica0"):
        p.heard(name, beat(name), 5.0)
    assert p.probe_due(6.0)  # never handled
    bound = 5.0 + w.LATE_READ_FACTOR * AFTER
    assert p.check(bound - 0.1) == ([], [])
    fatal, _ = p.check(bound)
    assert [x.name for x in fatal] == ["trainer0", "trainer1", "replica0"]


def test_a_watcher_whose_world_ended_without_it_is_forgotten():
    fake = _Fake()
    watcher = fake.watcher()
    w._current[:] = [watcher]
    try:
        watcher.received(beat("ps0", M1))
        assert w.machine_of("ps0") == f"machine1 ({M1.address}, torchrun group rank 1)"
        w._forget(watcher)  # (what its thread does once rpc.shutdown() ran without stop_watching)
        assert w.current_watcher() is None and w.machine_of("ps0") is None
    finally:
        w._current.clear()


def test_a_probe_refused_at_once_is_no_sign_of_a_backlog():
    p = Peers("ps0", LAYOUT, SETTINGS, 0.0, probing=True)
    assert p.probe_due(20.0)
    p.probed(False, 20.0)  # RPC refused it (shutting down): nothing waits in the queue
    assert p.heard_until(20.5) == 20.5
    assert p.probe_due(21.0)
    p.probed(False, 21.0 + AFTER)  # failed by its timeout: the queue is that far behind
    assert p.heard_until(21.0 + AFTER) == 20.0
    assert peers().heard_until(99.0) == 99.0 and not peers().probe_due(99.0)  # not probing


def test_a_failed_heartbeat_is_not_news_and_backs_off():
    p = peers()
    assert p.due(0.0) == ["trainer0", "trainer1", "replica0"]
    assert p.due(0.5) == []  # in flight: not sent twice
    p.answered("trainer0", None, False, RUNNING, 0.5)  # failed: nothing heard
    assert p.peers["trainer0"].last_heard == 0.0
    # its next heartbeat waits longer: 2 s, then (doubling) a third of lost_after at most
    gaps = []
    now = 0.0
    for _ in range(4):
        sent = p.peers["trainer0"].sent_at
        while "trainer0" not in p.due(now):
            now += 0.25
        gaps.append(now - sent)
        p.answered("trainer0", None, False, RUNNING, now)
    assert gaps == [2.0] + [pytest.approx(AFTER / 3, abs=0.25)] * 3
    p.answered("trainer0", beat("trainer0"), True, RUNNING, now)  # an answer: back to every heartbeat
    assert p.peers["trainer0"].every == HB


def test_leaving_sends_at_once():
    p = peers()
    for name in p.due(0.0):
        p.answered(name, beat(name), True, RUNNING, 0.1)
    assert p.due(0.2) == []
    p.leave()
    assert p.due(0.2) == ["trainer0", "trainer1", "replica0"]


def test_a_lost_machine_is_named_whole():
    # trainer0 and trainer1 share a machine; the first silent for lost_after brings the other,
    # silent for over two heartbeats, but not replica0, heard from a moment ago
    p = peers()
    p.heard("trainer0", beat("trainer0"), 1.0)
    p.heard("trainer1", beat("trainer1"), 1.8)
    p.heard("replica0", beat("replica0", origin=M0), 10.5)
    fatal, _ = p.check(11.0)
    assert [(x.name, round(x.silent_s, 1)) for x in fatal] == [("trainer0", 10.0), ("trainer1", 9.2)]
    assert not p.peers["trainer1"].in_flight and p.peers["replica0"].lost is None


def test_an_expendable_peer_is_reported_once_and_spared():
    p = peers(settings=SETTINGS._replace(expendable=frozenset({"replica"})))
    for name in ("trainer0", "trainer1"):
        p.heard(name, beat(name), 9.0)
    fatal, spared = p.check(10.0)
    assert fatal == [] and [x.name for x in spared] == ["replica0"] and spared[0].expendable
    assert p.check(11.0) == ([], [])
    assert "replica0" not in p.due(12.0)  # no heartbeats to a lost peer
    assert [x.name for x in p.spared()] == ["replica0"]


def test_survivors_wait_for_each_peer_to_leave_and_to_know_it():
    p = peers(settings=SETTINGS._replace(expendable=frozenset({"replica"})))
    p.survivors = True
    for name in ("trainer0", "trainer1"):
        p.heard(name, beat(name), 9.0)
    assert [x.name for x in p.check(10.0)[1]] == ["replica0"]  # lost, spared
    assert not p.survivors_ready(10.0)  # this rank is not leaving yet
    p.leave()
    for name in p.due(10.0):
        p.answered(name, beat(name), True, LEAVING, 10.1)  # they know: but are they leaving?
    assert not p.survivors_ready(10.1)
    p.heard("trainer0", beat("trainer0", phase=LEAVING), 10.2)
    assert not p.survivors_ready(10.2)
    p.heard("trainer1", beat("trainer1", phase=LEAVING), 10.3)
    assert p.survivors_ready(10.3)


def test_a_survivor_that_left_first_is_not_waited_for_nor_lost():
    p = peers(settings=SETTINGS._replace(expendable=frozenset({"replica"})))
    p.survivors = True
    for name in ("trainer0", "trainer1"):
        p.heard(name, beat(name), 9.0)
    assert [x.name for x in p.check(10.0)[1]] == ["replica0"]
    p.leave()
    p.heard("trainer0", beat("trainer0", phase=LEAVING), 10.0)  # leaving, never answered: then silent
    p.heard("trainer1", beat("trainer1", phase=LEAVING), 10.0)
    p.answered("trainer1", beat("trainer1", phase=LEAVING), True, LEAVING, 10.1)
    assert not p.survivors_ready(11.0)
    assert p.survivors_ready(12.0)  # two heartbeats of silence: it has left
    assert p.check(30.0) == ([], [])  # and a peer that left is never lost


def test_without_survivors_mode_a_silent_leaving_peer_is_lost():
    # torch's graceful shutdown needs every rank: one gone while shutting down blocks it
    p = peers()
    for name in ("trainer0", "trainer1", "replica0"):
        p.heard(name, beat(name, phase=LEAVING), 1.0)
    fatal, _ = p.check(11.0)
    assert [x.phase for x in fatal] == [LEAVING] * 3
    assert "in its graceful rpc.shutdown()" in fatal[0].describe()


# ---- what is said -------------------------------------------------------------------------

def test_lost_workers_are_named_by_machine_with_their_step():
    lost = [
        LostWorker("trainer1", 2, "trainer", M1, "step 41 of PSModel 'mlp'", RUNNING, 10.25, False),
        LostWorker("trainer0", 1, "trainer", M1, "", RUNNING, 9.5, False),
        LostWorker("ps0", 0, "ps", None, "", RUNNING, 10.0, False),
    ]
    assert describe_lost(lost) == (
        "ps0 (rank 0, not heard from for 10.0 s) on a machine never heard from; "
        "trainer0 (rank 1, pid 200, not heard from for 9.5 s) and "
        "trainer1 (rank 2, pid 200, at step 41 of PSModel 'mlp', not heard from for 10.2 s) "
        "on machine1 (10.42.0.2, torchrun group rank 1)"
    )
    assert Origin("vm", "127.0.0.1", "", 7).machine() == "vm (127.0.0.1)"


class _Fake:
    """A watcher's world: a clock the test moves, heartbeats the test answers, ends recorded."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sent: list[tuple[str, Beat]] = []
        self.pending: dict[str, object] = {}
        self.ended: list[WorkerLost] = []
        self.probes = 0

    def send(self, peer, beat_, timeout, done) -> None:
        if peer == beat_.name:  # the watcher's probe of its own queue: handled at once here
            self.probes += 1
            done(beat_, True)
            return
        self.sent.append((peer, beat_))
        if beat_.lost:
            done(None, True)  # the verdict is heard at once
        else:
            self.pending[peer] = done

    def answer_all(self, origin: Origin = M1, phase: str = RUNNING) -> None:
        for peer, done in list(self.pending.items()):
            del self.pending[peer]
            done(beat(peer, origin, phase), True)

    def watcher(self, me: str = "trainer0", settings: WatchSettings = SETTINGS) -> Watcher:
        return Watcher(me, LAYOUT, settings, origin=M0, send=self.send, clock=lambda: self.now,
                       end=self.ended.append)


def test_a_watcher_ends_its_rank_and_tells_the_others(caplog):
    fake = _Fake()
    watcher = fake.watcher()
    watcher.tick()
    assert sorted(p for p, _ in fake.sent) == ["ps0", "replica0", "trainer1"] and fake.probes == 1
    fake.answer_all()
    fake.now = 10.0
    watcher.received(beat("ps0", M0))
    fake.now = 10.5  # trainer1 and replica0 last answered at 0: silent for 10.5 s
    with caplog.at_level("ERROR", logger="rpc_backend.watch"):
        watcher.tick()
    [ended] = fake.ended
    assert [x.name for x in ended.lost] == ["trainer1", "replica0"]
    assert str(ended).startswith("rpc_backend: lost trainer1 (rank 2, pid 200, not heard from for 10.5 s) and "
                                 "replica0 (rank 3, pid 200, not heard from for 10.5 s) on machine1 "
                                 "(10.42.0.2, torchrun group rank 1) (noticed here")
    assert str(ended).endswith("ending trainer0") and str(ended) in caplog.text
    told = [(p, b.lost) for p, b in fake.sent if b.lost]
    assert told == [("ps0", tuple(ended.lost))]  # only the peers still heard from
    fake.now = 30.0
    watcher.tick()
    assert len(fake.ended) == 1  # ends once


def test_a_peer_on_another_machine_is_placed_by_its_last_heartbeat():
    fake = _Fake()
    watcher = fake.watcher()  # on machine0 (M0)
    assert watcher.machine_of("ps0") is None  # never heard from
    watcher.received(beat("ps0", M1))
    watcher.received(beat("trainer1", M0._replace(pid=101)))
    assert watcher.machine_of("ps0") == "machine1 (10.42.0.2, torchrun group rank 1)"
    assert watcher.machine_of("trainer1") is None and watcher.machine_of("nobody") is None  # (this machine)
    assert w.machine_of("ps0") is None  # no watcher runs in this process


def test_a_rank_told_of_a_loss_ends_naming_it():
    fake = _Fake()
    watcher = fake.watcher("ps0")
    lost = (LostWorker("trainer1", 2, "trainer", M1, "step 7 of PSModel 'x'", RUNNING, 10.2, False),)
    answer = watcher.received(beat("trainer0", M0)._replace(lost=lost))
    assert answer.name == "ps0" and answer.origin == M0
    [ended] = fake.ended
    assert ended.lost == list(lost)
    assert "trainer1 (rank 2, pid 200, at step 7 of PSModel 'x', not heard from for 10.2 s)" in str(ended)
    assert "noticed by trainer0" in str(ended) and str(ended).endswith("ending ps0")


def test_an_expendable_loss_is_reported_and_the_rank_goes_on(caplog):
    fake = _Fake()
    seen: list[LostWorker] = []
    remove = w.on_lost(seen.append)
    try:
        watcher = fake.watcher(settings=SETTINGS._replace(expendable=frozenset({"replica"})))
        for name in ("ps0", "trainer1"):
            watcher.received(beat(name))
        fake.now = 9.0
        for name in ("ps0", "trainer1"):
            watcher.received(beat(name))
        fake.now = 10.0
        with caplog.at_level("WARNING", logger="rpc_backend.watch"):
            watcher.tick()
    finally:
        remove()
    assert fake.ended == [] and [x.name for x in seen] == ["replica0"]
    assert "of the expendable role 'replica': the job goes on without it" in caplog.text
    assert [x.name for x in watcher.lost()] == ["replica0"]


def test_survivors_shut_down_once_every_one_left():
    fake = _Fake()
    watcher = fake.watcher(settings=SETTINGS._replace(expendable=frozenset({"replica"})))
    for name in ("ps0", "trainer1"):
        watcher.received(beat(name, phase=LEAVING))
    fake.now = 10.0
    for name in ("ps0", "trainer1"):
        watcher.received(beat(name, phase=LEAVING))
    watcher.tick()  # replica0 lost
    fake.answer_all(phase=LEAVING)  # (answers to heartbeats sent before this rank was leaving)
    assert watcher.wait_survivors(timeout=0.001) is False  # leaving not told yet
    watcher.leave()
    fake.answer_all(phase=LEAVING)
    calls = []
    w.shutdown_with_survivors(watcher, 60.0, lambda: calls.append("immediate"))  # (a hang guard only)
    assert calls == ["immediate"]


def test_a_status_is_reported_while_its_owner_lives():
    class Model:
        step = 3

    model = Model()
    removes = [w.add_status(lambda m: f"step {m.step}", owner=model), w.add_status(lambda: "epoch 2"),
               w.add_status(lambda: 1 / 0), w.add_status(lambda: None)]
    try:
        assert w.current_status() == "step 3; epoch 2"
        del model
        gc.collect()
        assert w.current_status() == "epoch 2"
        removes[1]()
        long = w.add_status(lambda: "x" * 500)
        assert len(w.current_status()) == w.MAX_STATUS_CHARS and w.current_status().endswith("...")
        long()
        assert w.current_status() == ""
    finally:
        for remove in removes:
            remove()


# ---- settings -----------------------------------------------------------------------------

def test_settings_from_arguments_then_variables_then_defaults():
    assert watch_settings(env={}) == WatchSettings(1.0, 10.0, frozenset())
    env = {w.HEARTBEAT_ENV: "0.5", w.LOST_AFTER_ENV: "4"}
    assert watch_settings(env=env) == WatchSettings(0.5, 4.0, frozenset())
    assert watch_settings(heartbeat=2, lost_after=20, env=env) == WatchSettings(2.0, 20.0, frozenset())
    for off in ("off", "OFF", "inf"):
        assert watch_settings(env={w.LOST_AFTER_ENV: off}) is None
    assert watch_settings(lost_after=math.inf, env={}) is None
    assert watch_settings(expendable=["replica"], roles=["ps", "replica"], env={}).expendable == {"replica"}


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(heartbeat=2, lost_after=3), ValueError, r"lost_after \(3.0 s\) must be at least twice heartbeat"),
    (dict(env={w.HEARTBEAT_ENV: "2", w.LOST_AFTER_ENV: "3"}), ValueError,
     r"RPC_BACKEND_LOST_AFTER_S \(3.0 s\) must be at least twice RPC_BACKEND_HEARTBEAT_S \(2.0 s\)"),
    (dict(heartbeat=0.001, lost_after=1), ValueError, r"heartbeat \(0.001 s\) is below 0.05 s"),
    (dict(env={w.HEARTBEAT_ENV: "0.001"}), ValueError, r"RPC_BACKEND_HEARTBEAT_S \(0.001 s\) is below"),
    (dict(lost_after=0), ValueError, "lost_after must be a positive number"),
    (dict(heartbeat=math.inf), ValueError, "heartbeat must be a finite"),
    (dict(env={w.HEARTBEAT_ENV: "off"}), ValueError, "RPC_BACKEND_HEARTBEAT_S must be a finite"),
    (dict(env={w.LOST_AFTER_ENV: "ten"}), ValueError, "RPC_BACKEND_LOST_AFTER_S='ten' is not a number"),
    (dict(env={w.HEARTBEAT_ENV: "-1"}), ValueError, "RPC_BACKEND_HEARTBEAT_S must be a positive"),
    (dict(expendable="replica"), TypeError, r"expendable=\('replica',\)"),
    (dict(expendable=("replica",), roles=("ps", "trainer")), ValueError, "'replica', which is not a role"),
])
def test_bad_settings_are_refused_by_name(kwargs, error, match):
    kwargs.setdefault("env", {})
    with pytest.raises(error, match=match):
        watch_settings(**kwargs)


def test_a_stopped_watcher_has_no_thread_left():
    # rpc_backend's shutdown stops the watcher: its heartbeat thread is gone when stop() returns
    fake = _Fake()
    watcher = fake.watcher()
    watcher.start()
    assert any(t.name == "rpc-backend-heartbeats" for t in threading.enumerate())
    watcher.stop()
    assert not any(t.name == "rpc-backend-heartbeats" for t in threading.enumerate())
