"""Hostile uses of RemotePipeline (issue 9) on the shared world."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed.rpc as rpc
from torch import nn

from remote_module import RemoteModule
from remote_module.pipeline import RemotePipeline, _host, split_sequential
from tests._deadlines import HANG_S
from tests.pipeline import _edge_cases_remote as phr

_clock = time.monotonic


def host_state(worker: str) -> dict:
    return rpc.rpc_sync(worker, phr.host_state)


def add_pipe(workers, chunks, timeout=HANG_S, pauses=None):
    pauses = pauses or [0.0] * len(workers)
    return RemotePipeline(
        [(f"{w}/cpu", phr.Add, (float(10 ** i), p), None) for i, (w, p) in enumerate(zip(workers, pauses))],
        chunks=chunks, timeout=timeout,
    )


def expected(x, n):
    """What the stages of :func:`add_pipe` compute locally, in the same order."""
    for i in range(n):
        x = x + float(10 ** i)
    return x


def in_threads(fns, seconds=HANG_S):
    """``fns`` run in threads at once: ("ok", value) or ("err", exception) each; ``seconds``
    is a hang guard."""
    results = [None] * len(fns)

    def run(i):
        try:
            results[i] = ("ok", fns[i]())
        except BaseException as exc:
            results[i] = ("err", exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds)
    hung = [i for i, t in enumerate(threads) if t.is_alive()]
    assert not hung, f"hang guard: threads {hung} still running after {seconds} s"
    return results


# ---- load: bursts, threads, shared stages, a second caller -------------------------------------


def assert_hosts_clean(workers) -> None:
    """No forward's order, waiter or inbox entry is left on the hosts or the caller."""
    for w in workers:
        assert host_state(w) == {"next": 0, "queue": 0, "busy": 0, "inbox": 0}, (w, host_state(w))
    assert not _host._inbox, f"caller inbox entries left: {list(_host._inbox)}"


def test_a_burst_of_forwards_is_exact_and_leaves_nothing_behind(rpc_world):
    pipe = add_pipe(["worker1", "worker2"], chunks=4)
    for _ in range(60):
        x = torch.randn(8, 3)
        assert torch.equal(pipe(x), expected(x, 2))
    assert_hosts_clean(["worker1", "worker2"])


@pytest.mark.parametrize("chunks", [16, 64])
def test_four_threads_on_one_pipeline_with_more_micro_batches_than_rpc_threads(rpc_world, chunks):
    pipe = add_pipe(["worker1", "worker2"], chunks=chunks)
    xs = [torch.randn(128, 3) for _ in range(4)]
    results = in_threads([lambda x=x: [torch.equal(pipe(x), expected(x, 2)) for _ in range(3)] for x in xs])
    assert results == [("ok", [True] * 3)] * 4, results
    assert_hosts_clean(["worker1", "worker2"])


def test_two_pipelines_sharing_a_stage_proxy_used_twice_in_one_of_them(rpc_world):
    a = RemoteModule("worker1/cpu", phr.Add, (1.0,))
    b = RemoteModule("worker2/cpu", phr.Add, (10.0,))
    c = RemoteModule("worker1/cpu", phr.Add, (100.0,))
    p1 = RemotePipeline([a, b], chunks=64, timeout=HANG_S)
    p2 = RemotePipeline([b, c, b], chunks=64, timeout=HANG_S)  # b twice: stage 0 and stage 2
    xs = [torch.randn(128, 3) for _ in range(4)]
    calls = [
        lambda x=xs[0]: torch.equal(p1(x), (x + 1.0) + 10.0),
        lambda x=xs[1]: torch.equal(p2(x), ((x + 10.0) + 100.0) + 10.0),
        lambda x=xs[2]: torch.equal(p1(x), (x + 1.0) + 10.0),
        lambda x=xs[3]: torch.equal(p2(x), ((x + 10.0) + 100.0) + 10.0),
    ]
    assert in_threads(calls) == [("ok", True)] * 4
    assert_hosts_clean(["worker1", "worker2"])


# (not "bare": tests/proxy/test_remote_module.py needs it to have imported nothing of ours)
@pytest.mark.parametrize("caller", ["worker1", "worker2"])  # each also hosts a stage
def test_the_pipeline_pickled_to_a_second_caller_runs_there(rpc_world, caller):
    pipe = add_pipe(["worker1", "worker2"], chunks=4)
    x = torch.randn(8, 3)
    assert torch.equal(rpc.rpc_sync(caller, phr.run_pipe, (pipe, x), timeout=HANG_S), expected(x, 2))


# ---- a last stage that does not return a batch -------------------------------------------------


# With one micro-batch nothing is concatenated: whatever the last stage returned is returned,
# as a local nn.Sequential would (next tests); only with chunks > 1 must it be a batch.
@pytest.mark.parametrize("kind", ["none", "dict", "list", "scalar", "mixed"])
def test_a_last_stage_not_returning_a_batch_is_named_with_what_it_returned(rpc_world, kind):
    pipe = RemotePipeline(
        [("worker1/cpu", phr.Add, (1.0,), None), ("worker2/cpu", phr.Returns, (kind,), None)],
        chunks=2, timeout=HANG_S
    )
    named = r"last pipeline stage \(stage 1 on worker 'worker2'\).*micro-batch \d of.*use chunks=1"
    with pytest.raises(TypeError, match=named):
        pipe(torch.arange(4.0).reshape(4, 1))


@pytest.mark.parametrize("kind", ["none", "dict", "list", "scalar"])
def test_one_micro_batch_returns_what_the_last_stage_returned(rpc_world, kind):
    pipe = RemotePipeline(
        [("worker1/cpu", phr.Add, (1.0,), None), ("worker2/cpu", phr.Returns, (kind,), None)],
        chunks=1, timeout=HANG_S
    )
    x = torch.arange(4.0).reshape(4, 1)
    expected = phr.Returns(kind)(x + 1.0)
    got = pipe(x)
    assert type(got) is type(expected)
    if kind == "dict":
        assert got.keys() == expected.keys() and torch.equal(got["x"], expected["x"])
    elif kind == "list":
        assert len(got) == 1 and torch.equal(got[0], expected[0])
    elif kind == "scalar":
        assert torch.equal(got, expected)


def test_a_pipeline_ending_in_an_lstm_returns_its_nested_tuple_as_nn_sequential(rpc_world):
    # word_language_model's layers: an LSTM returns (output, (h, c)); with one micro-batch the
    # pipeline returns that structure as nn.Sequential does (it was refused, the error then
    # suggesting chunks=1, the setting already in use)
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Embedding(20, 4), nn.LSTM(4, 4, 2))
    x = torch.randint(0, 20, (5, 3))
    with torch.no_grad():
        want = seq(x)
        got = split_sequential(seq, ["worker1/cpu", "worker2/cpu"], chunks=1, timeout=HANG_S)(x)
    assert type(got) is tuple and type(got[1]) is tuple
    assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    refused = r"micro-batch 0 of 2 returned a tuple of tensor\(3-d\), tuple.*use chunks=1"
    with torch.no_grad(), pytest.raises(TypeError, match=refused):
        split_sequential(seq, ["worker1/cpu", "worker2/cpu"], chunks=2, timeout=HANG_S)(x)  # h, c: batch on dim 1


def test_an_output_that_does_not_pickle_names_the_stage_and_leaves_nothing_behind(rpc_world):
    pipe = RemotePipeline(
        [("worker1/cpu", phr.Returns, ("lock",), None), ("worker2/cpu", phr.Add, (1.0,), None)],
        chunks=4, timeout=HANG_S
    )
    with pytest.raises(TypeError, match=r"(?s)pickle.*stage 0 on worker 'worker1'"):
        pipe(torch.randn(8, 3))
    assert_hosts_clean(["worker1", "worker2"])
