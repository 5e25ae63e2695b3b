"""The host-side device logic, tested on the CPU with the ``meta`` device standing in for an
accelerator (any non-CPU device type takes the same path: nothing says "cuda"), and the parsing of
remote device strings (``parse_remote_device``)."""

from collections import OrderedDict

import pytest
import torch

from remote_module._core.device import (
    move_cpu_tensors,
    parse_remote_device,
    prepare_inputs,
    prepare_output,
    tensors_to_cpu,
)
from remote_module._core.walk import map_tensors
from tests.proxy._remote import Pair

META = torch.device("meta")


def test_map_tensors_keeps_structure():
    t = torch.arange(6.0).reshape(3, 2)
    obj = {"a": [t, (t, 5)], "b": Pair(t, "s"), "c": OrderedDict(x=t), "d": None}
    out = map_tensors(lambda x: x + 1, obj)
    assert type(out["b"]) is Pair and out["b"].second == "s"
    assert type(out["c"]) is OrderedDict
    assert isinstance(out["a"], list) and isinstance(out["a"][1], tuple) and out["a"][1][1] == 5
    for got in (out["a"][0], out["a"][1][0], out["b"].first, out["c"]["x"]):
        assert torch.equal(got, t + 1)
    assert out["d"] is None


def test_single_tensor_output_is_not_split_into_rows():
    # torch's RemoteModule iterates over the output, turning a (3, 2) tensor into 3 rows.
    t = torch.ones(3, 2)
    out = tensors_to_cpu(t)
    assert isinstance(out, torch.Tensor) and out.shape == (3, 2)
    out = prepare_output(t, META, is_device_map_set=False)
    assert isinstance(out, torch.Tensor) and out.shape == (3, 2)


def test_cpu_inputs_move_at_any_depth():
    t = torch.ones(2)
    args, kwargs = prepare_inputs((t, [t, {"k": t}], 3), {"kw": (t,)}, META)
    assert args[0].device == META
    assert args[1][0].device == META and args[1][1]["k"].device == META
    assert args[2] == 3
    assert kwargs["kw"][0].device == META


def test_cpu_module_leaves_inputs_alone():
    t = torch.ones(2)
    args, kwargs = prepare_inputs((t,), {"k": t}, torch.device("cpu"))
    assert args[0] is t and kwargs["k"] is t


def test_tensors_already_off_cpu_are_not_moved():
    on_meta = torch.empty(2, device=META)
    moved = []

    def record(x):
        moved.append(x.device)
        return x

    out = move_cpu_tensors([on_meta], META)
    assert out[0] is on_meta
    map_tensors(record, [on_meta])
    assert moved == [META]


def test_output_kept_when_device_map_set():
    on_meta = torch.empty(2, device=META)
    assert prepare_output(on_meta, META, is_device_map_set=True) is on_meta


def test_output_to_cpu_without_device_map():
    # tensors_to_cpu calls .cpu() on every non-CPU tensor; use a CPU subclass trick-free check:
    seen = []
    out = map_tensors(lambda x: seen.append(x.shape) or x, Pair(torch.ones(2, 2), [torch.ones(3)]))
    assert seen == [(2, 2), (3,)]
    assert isinstance(out, Pair)
    cpu = tensors_to_cpu({"a": [torch.ones(1)], "b": (torch.zeros(2),)})
    assert cpu["a"][0].device.type == "cpu" and cpu["b"][0].device.type == "cpu"


# ---- parse_remote_device -----------------------------------------------------------------

VALID = [
    ("worker1/cpu", "worker1", None, "cpu"),
    ("worker1", "worker1", None, "cpu"),
    ("trainer0/cuda:0", "trainer0", None, "cuda:0"),
    ("rank:1/cpu", None, 1, "cpu"),
    ("rank:12", None, 12, "cpu"),
    ("ps_0/meta", "ps_0", None, "meta"),
]


@pytest.mark.parametrize("text,name,rank,device", VALID)
def test_valid(text, name, rank, device):
    parsed = parse_remote_device(text)
    assert parsed.worker_name == name
    assert parsed.rank == rank
    assert parsed.device == torch.device(device)
    assert parsed.worker == (name if name is not None else rank)


@pytest.mark.parametrize(
    "text",
    ["", "/", "worker1/", "/cpu", "a/b/c", "rank:x/cpu", "rank:/cpu", "foo:1/cpu", "cpu", "cuda:0",
     " worker1/cpu", "work er/cpu", "worker1/cpu/"],
)
def test_unparsable(text):
    with pytest.raises(ValueError) as info:
        parse_remote_device(text)
    assert str(info.value) == f"Could not parse remote_device: {text}. The valid format is '<workername>/<device>'"


def test_bad_device_is_torchs_own_error():
    with pytest.raises(RuntimeError) as ours:
        parse_remote_device("worker1/cdua:0")
    with pytest.raises(RuntimeError) as torchs:
        torch.device("cdua:0")
    assert str(ours.value) == str(torchs.value)


@pytest.mark.parametrize("value", [None, 1, ("worker1", "cpu"), b"worker1/cpu"])
def test_not_a_string(value):
    with pytest.raises(TypeError, match="remote_device must be a str"):
        parse_remote_device(value)
