"""RemotePipeline forward against the shared RPC world: equal to the stages run locally, for
any micro-batching; tuple outputs, several inputs, stages given as proxies or tuples; bad
input refused before anything is sent. (Training: tests/pipeline/test_training.py; activations and
overlap: tests/pipeline/test_flow.py; nn.Module citizenship and split_sequential:
tests/pipeline/test_module.py; where split_sequential cuts: tests/pipeline/test_balance.py; failures are
tested with the pipeline's faults.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from remote_module import RemoteModule
from remote_module.pipeline import RemotePipeline, _pipeline, split_sequential
from tests._marks import GRAD_ON_WITHOUT_CONTEXT
from tests.pipeline._remote import Fork, Heads, Join, Mix, Timed, on_host, recorded, seeded_linear

pytestmark = [pytest.mark.usefixtures("rpc_world"), GRAD_ON_WITHOUT_CONTEXT]

W1, W2 = "worker1/cpu", "worker2/cpu"


@pytest.fixture(autouse=True)
def _same_inputs_every_run():
    torch.manual_seed(0)


def mlp() -> nn.Sequential:
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model



def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def mlp_pipes():
    model = mlp()
    return model, {c: split_sequential(model, [W1, W2], chunks=c) for c in (1, 2, 4)}


# ---- equal to the local model ------------------------------------------------------------------


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("batch", [8, 10, 3, 1])
@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_forward_equals_local_sequential(mlp_pipes, chunks, batch, grad):
    model, pipes = mlp_pipes
    x = torch.randn(batch, 6)
    with torch.set_grad_enabled(grad):
        out = pipes[chunks](x)
    with torch.no_grad():
        expected = model(x)
    close(out, expected)


@pytest.mark.parametrize(
    "batch, chunks, sizes",
    [(8, 4, [2, 2, 2, 2]), (10, 4, [3, 3, 2, 2]), (3, 4, [1, 1, 1]), (1, 4, [1]), (5, 1, [5]), (6, 2, [3, 3])],
)
def test_micro_batches_are_the_tensor_split_of_the_batch(batch, chunks, sizes):
    pipe = RemotePipeline([(W1, Timed, (0.0,), None), (W2, Timed, (0.0,), None)], chunks)
    x = torch.arange(batch * 2, dtype=torch.float32).reshape(batch, 2)
    assert torch.equal(pipe(x), x)
    firsts = [float(part[0, 0]) for part in torch.tensor_split(x, len(sizes))]
    for stage in pipe.stages:
        calls = on_host(stage, recorded, "calls")
        assert [rows for *_, rows in calls] == sizes
        assert sorted(first for _, _, first, _ in calls) == firsts


def test_tuple_outputs_are_the_next_stages_positional_arguments():
    pipe = RemotePipeline([(W1, Fork, (5, 1), None), (W2, Join, (5, 4, 2), None)], chunks=3)
    x = torch.randn(7, 5)
    with torch.no_grad():
        close(pipe(x), Join(5, 4, 2)(*Fork(5, 1)(x)))


def test_a_last_stage_returning_a_tuple_gives_a_tuple_of_concatenated_outputs():
    pipe = RemotePipeline([(W1, nn.Linear, (4, 6), None), (W2, Heads, (6, 3), None)], chunks=4)
    first = pipe.stages[0].get_module_rref().to_here()
    x = torch.randn(10, 4)
    out = pipe(x)
    with torch.no_grad():
        expected = Heads(6, 3)(first(x))
    assert isinstance(out, tuple) and len(out) == 2
    close(out[0], expected[0])  # (10, 3)
    close(out[1], expected[1])  # (10, 1)


def test_several_inputs_are_split_alike_and_given_to_stage_0():
    pipe = RemotePipeline([(W1, Mix, (4, 5), None), (W2, Fork, (4, 6), None), (W1, Join, (4, 2, 7), None)], chunks=4)
    x, y = torch.randn(9, 4), torch.randn(9, 4)
    with torch.no_grad():
        expected = Join(4, 2, 7)(*Fork(4, 6)(Mix(4, 5)(x, y)))
    close(pipe(x, y), expected)


def test_a_pipeline_of_existing_proxies():
    stages = [RemoteModule(W2, seeded_linear, (4, 8, 3)), RemoteModule(W1, seeded_linear, (8, 2, 4))]
    pipe = RemotePipeline(stages, chunks=2)
    assert list(pipe.stages) == stages  # the same proxies, not copies
    x = torch.randn(6, 4)
    with torch.no_grad():
        close(pipe(x), seeded_linear(8, 2, 4)(seeded_linear(4, 8, 3)(x)))
    # proxies and tuples mixed
    mixed = RemotePipeline([stages[0], (W2, seeded_linear, (8, 2, 4), None)], chunks=3)
    assert mixed.stages[0] is stages[0] and isinstance(mixed.stages[1], RemoteModule)
    close(mixed(x), pipe(x))


def test_three_stages_two_of_them_on_the_same_worker():
    layers = [seeded_linear(4, 6, 10), seeded_linear(6, 6, 11), seeded_linear(6, 3, 12)]
    pipe = RemotePipeline(
        [(W1, seeded_linear, (4, 6, 10), None), (W2, seeded_linear, (6, 6, 11), None),
         (W2, seeded_linear, (6, 3, 12), None)],
        chunks=4,
    )
    assert [s.on for s in pipe.stages] == ["worker1", "worker2", "worker2"]
    x = torch.randn(11, 4)
    with torch.no_grad():
        close(pipe(x), nn.Sequential(*layers)(x))


# ---- bad input: a clear error, nothing sent ----------------------------------------------------


@pytest.fixture
def nothing_sent(monkeypatch):
    """Fails the test if the pipeline sends a micro-batch or creates a stage."""
    sent: list[tuple] = []

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        sent.append(args)
        raise AssertionError(f"sent {args!r}")

    monkeypatch.setattr(_pipeline, "call_async", spy)
    monkeypatch.setattr(_pipeline.RemoteModule, "create_async", spy)
    yield sent
    assert sent == []


@pytest.mark.parametrize("chunks", [0, -1, True, 2.5, "2", None])
def test_bad_chunks_are_refused(nothing_sent, chunks):
    with pytest.raises(ValueError, match=rf"chunks must be a positive int.*got {chunks!r}"):
        RemotePipeline([(W1, nn.Linear, (2, 2), None)], chunks=chunks)


def test_bad_stages_are_refused(nothing_sent):
    with pytest.raises(ValueError, match="at least one stage, got an empty list"):
        RemotePipeline([])
    with pytest.raises(TypeError, match="stages must be a list"):
        RemotePipeline(3)
    with pytest.raises(TypeError, match=r"stages\[1\] must be a RemoteModule or a tuple.*got Linear"):
        RemotePipeline([(W1, nn.Linear, (2, 2), None), nn.Linear(2, 2)])
    with pytest.raises(TypeError, match=r"stages\[0\] must be .*got tuple"):
        RemotePipeline([(W1, nn.Linear, (2, 2))])  # kwargs missing
    with pytest.raises(TypeError, match=r"stages\[0\] must be .*got str"):
        RemotePipeline(["worker1/cpu"])


@pytest.fixture(scope="module")
def small_pipe():
    return RemotePipeline([(W1, nn.Linear, (3, 3), None), (W2, nn.Linear, (3, 2), None)], chunks=2)


@pytest.mark.parametrize(
    "args, error, message",
    [
        ((torch.tensor(1.0),), TypeError, r"tensors with a batch dimension.*x = Tensor with no dimensions"),
        (([[1.0, 2.0, 3.0]],), TypeError, r"tensors with a batch dimension.*x = list"),
        ((torch.ones(2, 3), 5), TypeError, r"tensors with a batch dimension.*more\[0\] = int"),
        ((torch.ones(4, 3), torch.ones(3, 3)), ValueError, r"same size on dim 0.*got \[4, 3\]"),
    ],
    ids=["0-dim", "not-a-tensor", "extra-not-a-tensor", "different-batches"],
)
def test_bad_forward_inputs_are_refused(small_pipe, nothing_sent, args, error, message):
    with pytest.raises(error, match=message):
        small_pipe(*args)


def test_the_same_proxy_as_two_stages_shares_its_weights():
    shared = RemoteModule(W1, seeded_linear, (5, 5, 20))
    pipe = RemotePipeline([shared, (W2, nn.Tanh, (), None), shared], chunks=4)
    layer = seeded_linear(5, 5, 20)
    x = torch.randn(10, 5)
    with torch.no_grad():
        close(pipe(x), layer(torch.tanh(layer(x))))
