"""RemotePipeline as an nn.Module (repr, train/eval, state_dict) and split_sequential (where it
cuts, names kept, checkpoints interchangeable with the local nn.Sequential, bad arguments)."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
import torch.distributed.autograd as dist_autograd
from torch import nn

from remote_module.pipeline import RemotePipeline, _pipeline, split_sequential
from tests.pipeline._remote import Tied, child_names, on_host, requires_grad_flags, training_flags

pytestmark = pytest.mark.usefixtures("rpc_world")

W1, W2 = "worker1/cpu", "worker2/cpu"


@pytest.fixture(autouse=True)
def _same_inputs_every_run():
    torch.manual_seed(0)


def model(seed: int = 0) -> nn.Sequential:
    """Parameters per layer: 576, 0, 0, 520, 72 (so by parameters the cut is [3, 2])."""
    g = torch.Generator().manual_seed(seed)
    m = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 8), nn.Linear(8, 8))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m.eval()  # Dropout off, so outputs compare


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


def stages_of(pipe: RemotePipeline) -> list[list[str]]:
    return [on_host(stage, child_names) for stage in pipe.stages]


# ---- nn.Module citizenship ---------------------------------------------------------------------


def test_repr_lists_the_stages_and_their_workers():
    pipe = split_sequential(model(), [W1, W2], chunks=2)
    text = repr(pipe)
    assert text.startswith("RemotePipeline(\n  chunks=2\n  (stages): ModuleList(")
    first, second = (text.index("(0): RemoteModule(on=worker1, device=cpu"),
                     text.index("(1): RemoteModule(on=worker2, device=cpu"))
    assert first < text.index("(0): Linear(in_features=8, out_features=64") < text.index("(2): Dropout") < second
    assert second < text.index("(4): Linear(in_features=8, out_features=8")


def test_train_and_eval_reach_every_stage_and_its_submodules():
    pipe = split_sequential(model(), [W1, W2, W2], balance=[2, 2, 1])  # copies of an eval() model

    def flags() -> list[dict[str, bool]]:
        return [on_host(stage, training_flags) for stage in pipe.stages]

    assert [sorted(f) for f in flags()] == [["", "0", "1"], ["", "2", "3"], ["", "4"]]
    # the layers keep their mode (eval); each stage's container is new, like sequential[a:b]
    assert not any(v for f in flags() for k, v in f.items() if k)
    assert pipe.train() is pipe
    assert all(v for f in flags() for v in f.values())
    assert all(stage.training for stage in pipe.stages)
    assert pipe.eval() is pipe
    assert pipe.training is False
    assert not any(v for f in flags() for v in f.values())
    assert not any(stage.training for stage in pipe.stages)


def test_requires_grad_reaches_every_stage_as_on_the_local_sequential():
    # nn.Module.requires_grad_ walks the pipeline's own parameters, and the stage proxies hold
    # none: pipe.requires_grad_(False) was a silent no-op, the stages kept training (seen
    # freezing a nanoGPT split into a pipeline)
    pipe = split_sequential(model(), [W1, W2], chunks=2)

    def flags() -> list[bool]:
        return [v for stage in pipe.stages for v in on_host(stage, requires_grad_flags).values()]

    assert pipe.requires_grad_(False) is pipe
    assert flags() == [False] * 6
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing can train now: no warning about training
        out = pipe(x)
    assert not out.requires_grad  # as model().requires_grad_(False)(x)
    assert not any(stage.remote_trainable for stage in pipe.stages)
    pipe.requires_grad_()
    assert flags() == [True] * 6
    assert all(stage.remote_trainable for stage in pipe.stages)
    with dist_autograd.context():
        assert pipe(x).requires_grad


def test_a_deep_copy_runs_on_copies_of_the_stages():
    pipe = RemotePipeline([(W1, nn.Linear, (3, 4), None), (W2, nn.Linear, (4, 2), None)], chunks=2)
    x = torch.randn(4, 3)
    with torch.no_grad():
        before = pipe(x)
        twin = copy.deepcopy(pipe)
        assert not twin._warned_untrained and twin.chunks == 2
        assert [s.module_key for s in twin.stages] != [s.module_key for s in pipe.stages]
        close(twin(x), before)
        first = pipe.stages[0]  # the original's weights change; the copy's do not
        first.load_state_dict({k: torch.zeros_like(v) for k, v in first.state_dict().items()})
        close(twin(x), before)
        assert not torch.allclose(pipe(x), before)


def test_state_dict_keys_are_stages_i_then_the_stage_modules_own_keys():
    pipe = RemotePipeline([(W1, nn.Linear, (3, 4), None), (W2, nn.BatchNorm1d, (4,), None)])
    assert list(pipe.state_dict()) == [
        "stages.0.weight", "stages.0.bias",
        "stages.1.weight", "stages.1.bias", "stages.1.running_mean", "stages.1.running_var",
        "stages.1.num_batches_tracked",
    ]
    split = split_sequential(model(), [W1, W2])
    assert list(split.state_dict()) == [
        "stages.0.0.weight", "stages.0.0.bias",
        "stages.1.3.weight", "stages.1.3.bias", "stages.1.4.weight", "stages.1.4.bias",
    ]


def test_a_checkpoint_loads_into_the_local_sequential_and_back():
    pipe = split_sequential(model(0), [W1, W2], chunks=4)
    x = torch.randn(9, 8)
    checkpoint = pipe.state_dict()
    # pipeline -> local: strip "stages.<i>."
    local = model(1)
    local.load_state_dict({key.split(".", 2)[2]: value for key, value in checkpoint.items()}, strict=True)
    with torch.no_grad():
        close(local(x), pipe(x))
    # local -> pipeline: put "stages.<i>." back, by the stage that holds each layer
    other = model(2)
    stage_of = {key.split(".", 2)[2]: key.split(".", 2)[1] for key in checkpoint}
    pipe.load_state_dict({f"stages.{stage_of[k]}.{k}": v for k, v in other.state_dict().items()}, strict=True)
    with torch.no_grad():
        close(pipe(x), other(x))
    # strict loading still checks the keys
    partial = dict(checkpoint)
    del partial["stages.1.4.bias"]
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*stages\.1\.4\.bias"):
        pipe.load_state_dict(partial, strict=True)
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*stages\.0\.3\.weight"):
        pipe.load_state_dict({**checkpoint, "stages.0.3.weight": torch.zeros(8, 64)}, strict=True)


# ---- split_sequential --------------------------------------------------------------------------


def test_split_keeps_the_child_names_and_equals_the_local_model():
    local = model()
    pipe = split_sequential(local, [W1, W2], balance=[1, 4], chunks=3)
    assert [s.on for s in pipe.stages] == ["worker1", "worker2"] and pipe.chunks == 3
    assert stages_of(pipe) == [["0"], ["1", "2", "3", "4"]]
    x = torch.randn(7, 8)
    with torch.no_grad():
        close(pipe.eval()(x), local(x))


@pytest.mark.parametrize(
    "devices, stages",
    [
        ([W1, W2], [["0", "1", "2"], ["3", "4"]]),
        ([W1, W2, W1], [["0", "1", "2"], ["3"], ["4"]]),
        ([W2], [["0", "1", "2", "3", "4"]]),
    ],
)
def test_default_balance_by_parameters_keeps_parameter_free_layers_with_the_layer_before(devices, stages):
    pipe = split_sequential(model(), devices)
    assert stages_of(pipe) == stages


def test_split_copies_the_weights_and_leaves_the_local_sequential_alone():
    local = model()
    before = {k: v.clone() for k, v in local.state_dict().items()}
    children = list(local.children())
    pipe = split_sequential(local, [W1, W2], balance=[2, 3])
    assert list(local.children()) == children and list(local._modules) == ["0", "1", "2", "3", "4"]
    assert all(torch.equal(local.state_dict()[k], v) for k, v in before.items())
    assert not local.training  # still as it was (eval)
    x = torch.randn(4, 8)
    with torch.no_grad():
        expected = local(x)
        local[0].weight.add_(1.0)  # the hosts hold copies
    with torch.no_grad():
        close(pipe.eval()(x), expected)


@pytest.fixture
def nothing_created(monkeypatch):
    created: list[tuple] = []

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        created.append(args)
        raise AssertionError(f"a stage was created: {args!r}")

    monkeypatch.setattr(_pipeline.RemoteModule, "create_async", spy)
    yield
    assert created == []


@pytest.mark.parametrize(
    "sequential, devices, balance, error, message",
    [
        (model(), [W1, W2], [2, 2], ValueError, r"balance \[2, 2\] covers 4 layers but the nn.Sequential has 5"),
        (model(), [W1, W2], [5], ValueError, r"balance has 1 entries but there are 2 remote devices"),
        (model(), [W1, W2], [0, 5], ValueError, r"balance must hold positive ints.*\[0, 5\]"),
        (model(), [W1, W2], [2.5, 2.5], ValueError, r"balance must hold positive ints"),
        (model(), [W1, W2], 5, TypeError, r"balance must be a sequence of ints.*got 5"),
        (model(), "worker1/cpu", None, TypeError, r"remote_devices must be a list.*'worker1/cpu'"),
        (model(), [], None, ValueError, r"remote_devices is empty"),
        (nn.Sequential(nn.Linear(2, 2)), [W1, W2], None, ValueError, r"1 layers into 2 stages"),
        (nn.Sequential(nn.Linear(2, 2), nn.ReLU()), [W1, W2], None, ValueError, r"only 1 group"),
        (nn.Linear(2, 2), [W1], None, TypeError, r"takes an nn.Sequential, got Linear"),
    ],
    ids=["sum", "length", "zero", "float", "not-a-list", "devices-str", "no-devices", "too-few-layers",
         "too-few-units", "not-sequential"],
)
def test_bad_split_arguments_are_refused(nothing_created, sequential, devices, balance, error, message):
    with pytest.raises(error, match=message):
        split_sequential(sequential, devices, balance)


def test_an_unknown_worker_is_named():
    with pytest.raises(ValueError, match="'nosuchworker', which is not in this RPC world"):
        split_sequential(model(), [W1, "nosuchworker/cpu"])


# ---- layers that share state (issue 20) ----------------------------------------------------------


def _lin() -> nn.Linear:
    return nn.Linear(4, 4)


def same_module_twice() -> nn.Sequential:  # the model
    lin = _lin()
    return nn.Sequential(lin, nn.Tanh(), lin)


def shared_submodule() -> nn.Sequential:
    lin = _lin()
    return nn.Sequential(lin, nn.Tanh(), nn.Sequential(lin, nn.ReLU()))


def shared_parameter() -> nn.Sequential:
    lin = _lin()
    return nn.Sequential(lin, nn.Tanh(), Tied(lin))


@pytest.mark.parametrize(
    "make, balance, names",
    [
        (same_module_twice, [2, 1], r"the same Linear is layer 0 \('0'\) and layer 2 \('2'\)"),
        (same_module_twice, [1, 2], r"the same Linear is layer 0 \('0'\) and layer 2 \('2'\)"),
        (shared_submodule, [2, 1], r"layer 2 \('2'\) shares module '2.0' with layer 0 \(as '0'\)"),
        (shared_parameter, [1, 2], r"layer 2 \('2'\) shares parameter '2.weight' with layer 0 \(as '0.weight'\)"),
    ],
    ids=["same-module-late-cut", "same-module-early-cut", "submodule", "parameter"],
)
def test_a_balance_cutting_between_layers_that_share_state_is_refused_naming_them(
    nothing_created, make, balance, names
):
    with pytest.raises(ValueError) as info:
        split_sequential(make(), [W1, W2], balance)
    text = str(info.value)
    assert re.search(names, text), text
    assert f"balance {balance!r} puts layers 0 and 2" in text and "on different stages" in text
    assert "Keep layers 0..2 on one stage" in text and "use fewer remote devices" in text


def test_without_balance_layers_that_share_state_and_leave_too_few_groups_are_named(nothing_created):
    with pytest.raises(ValueError) as info:
        split_sequential(same_module_twice(), [W1, W2])
    text = str(info.value)
    assert "into 2 stages" in text and "only 1 group" in text, text
    assert "the same Linear is layer 0 ('0') and layer 2 ('2')" in text, text


def test_a_balance_keeping_shared_layers_together_is_suggested(nothing_created):
    lin = _lin()
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), lin, nn.Tanh(), lin, nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"layers 2 and 4 .*Keep layers 2..4 on one stage \(e.g. balance=\[2, 4\]"):
        split_sequential(model, [W1, W2], [3, 3])


def test_a_parameter_free_module_used_twice_may_be_cut():
    act = nn.Tanh()
    model = nn.Sequential(nn.Linear(4, 4), act, nn.Linear(4, 4), act)
    pipe = split_sequential(model, [W1, W2], [2, 2])
    assert stages_of(pipe) == [["0", "1"], ["2", "3"]]
    x = torch.randn(3, 4)
    with torch.no_grad():
        close(pipe(x), model(x))
