"""Local worlds whose ranks watch each other (rpc_backend/watch.py): a frozen rank ends the
world with every other naming it, a rank blocked where no signal reaches exits anyway, and an
expendable rank's loss is reported while the world goes on.

A killed rank is noticed by run_local itself at once (as before); a frozen one (SIGSTOP) only
by the heartbeats. Short settings (heartbeat 0.5 s, lost after 5 s) keep these quick; a rank
is lost only after missing ten heartbeats, which no scheduler delays on a loaded machine.
"""

from __future__ import annotations

import logging
import re

import pytest

from rpc_backend import LocalWorldError, run_local
from rpc_backend.watch import END_GRACE_S
from tests._deadlines import HANG_S, SETUP_S
from tests.backend import _watch_remote

pytestmark = [pytest.mark.slow, pytest.mark.timeout(SETUP_S + 2 * HANG_S)]
QUICK = dict(heartbeat=0.5, lost_after=5.0, timeout=SETUP_S + HANG_S)


def test_a_frozen_rank_ends_the_world_and_is_named():
    with pytest.raises(LocalWorldError) as caught:
        run_local(_watch_remote.freeze_the_last_rank, 3, **QUICK)
    error = caught.value
    assert error.rank in (0, 1), error  # a survivor failed, not the frozen rank
    text = str(error)
    assert "WorkerLost: rpc_backend: lost worker2 (rank 2, pid " in text, text
    silent = float(re.search(r"worker2 \(rank 2, pid \d+, not heard from for ([\d.]+) s\)", text).group(1))
    assert silent >= 5.0, text
    assert re.search(rf"ending worker{error.rank}$", text.strip()), text


def test_a_rank_blocked_in_a_call_to_the_lost_peer_exits_after_the_grace(capfd):
    with pytest.raises(LocalWorldError) as caught:
        run_local(_watch_remote.call_a_frozen_rank, 2, **QUICK)
    assert caught.value.rank == 0 and "exited with code 1 without a result" in str(caught.value), caught.value
    err = capfd.readouterr().err
    assert re.search(rf"lost worker1 \(rank 1, pid \d+, not heard from for [\d.]+ s\) .*ending worker0 "
                     rf"\(the rank did not end within {END_GRACE_S:g} s of it: exiting\)", err), err[-3000:]


def test_an_expendable_rank_is_reported_and_the_world_goes_on(caplog):
    roles = {"ps": 1, "trainer": 1, "replica": 1}
    with caplog.at_level(logging.WARNING, logger="rpc_backend.run_local"):
        values = run_local(_watch_remote.lose_the_replica, 3, roles=roles, expendable=("replica",), **QUICK)
    assert values == ["served", ["replica0"], None]
    assert "rank 2 (replica0), of an expendable role, is lost" in caplog.text


def test_a_frozen_expendable_rank_is_ended_and_the_world_goes_on(caplog):
    # a frozen process never exits: run_local hears of the loss from the ranks' heartbeats,
    # kills it and returns (it waited for the process until its timeout before)
    roles = {"ps": 1, "trainer": 1, "replica": 1}
    with caplog.at_level(logging.WARNING, logger="rpc_backend.run_local"):
        values = run_local(_watch_remote.freeze_the_replica, 3, roles=roles, expendable=("replica",), **QUICK)
    assert values == ["served", ["replica0"], None]
    assert re.search(r"rank 2 \(replica0\), of an expendable role, is lost: not heard from for [\d.]+ s "
                     r"\(noticed by (ps0|trainer0)\)", caplog.text), caplog.text


def test_a_rank_behind_a_backlog_of_calls_blames_no_one():
    # worker1's RPC threads are all held and calls queue behind them: worker0's heartbeats
    # wait in that queue, so worker1 hears nothing from it for twice lost_after. Its own probe
    # waits there too, so it counts no silence it has not yet read: nobody is lost, every call
    # is answered (found by a port: 10,000 calls of 50 ms ended a healthy job)
    values = run_local(_watch_remote.a_backlog_is_not_silence, 2, **QUICK)
    assert values == [_watch_remote.BACKLOG, {"lost": [], "lag_over_lost_after": True}], values
