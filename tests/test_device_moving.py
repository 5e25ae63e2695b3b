"""The host-side device logic, tested on the CPU with the ``meta`` device standing in for an
accelerator (any non-CPU device type takes the same path: nothing says "cuda")."""

from collections import OrderedDict

import torch

from remote_module._core.device import move_cpu_tensors, prepare_inputs, prepare_output, tensors_to_cpu
from remote_module._core.walk import map_tensors
from tests._remote import Pair

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
