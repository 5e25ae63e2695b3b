"""Classes the host cannot import travel by value (cloudpickle) or, where the receiver runs the
same code, as the receiver's own object; importable ones by reference."""

import collections
import dataclasses
import importlib.util
import io
import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed.autograd as dist_autograd
from torch.distributed.optim import DistributedOptimizer

from remote_module import RemoteModule
from remote_module._proxy import shipping as _shipping
from remote_module._proxy.shipping import (
    ByValue,
    by_value_reduce,
    importable_by_reference,
    pack_constructor,
    unpack_constructor,
)
from tests._deadlines import HANG_S, SETUP_S
from tests.proxy._remote import Affine
from tests.proxy._shipping_remote import Holder

ROOT = Path(__file__).resolve().parents[2]


def test_what_goes_by_reference():
    class Local(torch.nn.Module):
        pass

    assert importable_by_reference(Affine)
    assert importable_by_reference(torch.nn.Linear)
    assert not importable_by_reference(Local)
    assert not importable_by_reference(lambda: Affine())
    Main = type("Main", (torch.nn.Module,), {"__module__": "__main__"})
    assert not importable_by_reference(Main)
    cls, args, kwargs = pack_constructor(Affine, (4,), {"seed": 1})
    assert (cls, args, kwargs) == (Affine, (4,), {"seed": 1})
    packed, args, kwargs = pack_constructor(Local, (), {})
    assert isinstance(packed, ByValue) and args == () and kwargs == {}
    assert packed.load()[0].__qualname__ == Local.__qualname__


def test_importable_class_with_a_local_argument_goes_by_value():
    class Config:
        n = 4

    packed, _, _ = pack_constructor(Affine, (Config(),), {})
    assert isinstance(packed, ByValue)


@pytest.mark.usefixtures("rpc_world")
def test_class_defined_inside_a_function_runs_and_trains_remotely():
    class Scaler(torch.nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.arange(float(n)))

        def forward(self, x: torch.Tensor, bias: float = 0.0) -> torch.Tensor:
            return x * self.w + bias

    proxy = RemoteModule("worker2/cpu", Scaler, (3,))
    assert proxy.remote_type.endswith("Scaler")
    x = torch.ones(3)
    with torch.no_grad():  # inference (outside dist_autograd, grad on would warn that it trains nothing)
        assert proxy(x, bias=1.0).tolist() == [1.0, 2.0, 3.0]
        assert proxy.forward_async(x).wait().tolist() == [0.0, 1.0, 2.0]
    opt = DistributedOptimizer(torch.optim.SGD, proxy.remote_parameters(), lr=1.0)
    with dist_autograd.context() as ctx:
        dist_autograd.backward(ctx, [proxy(x).sum()])
        opt.step(ctx)
    with torch.no_grad():
        assert proxy(x).tolist() == [-1.0, 0.0, 1.0]  # w - lr * d(sum)/dw = w - 1


def test_main_class_in_a_script_run_by_the_local_launcher():
    out = subprocess.run(
        [sys.executable, "tests/proxy/scripts/main_class_job.py"], cwd=ROOT, capture_output=True, text=True,
        timeout=SETUP_S + HANG_S,  # the script starts a world (SETUP_S inside it), then waits for it
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    assert result["out"] == [2.0, 2.0, 2.0]
    assert result["after"] == [1.5, 1.5, 1.5]  # w - 0.5 * 1
    assert result["type"].endswith("MainNet")


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        reduced = by_value_reduce(obj)
        return NotImplemented if reduced is None else reduced


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf).dump(obj)
    return buf.getvalue()


def test_by_value_reduce_leaves_ordinary_objects_alone_and_decides_once(monkeypatch):
    def local():
        return 1

    objects = [torch.ones(2), 3, [1, 2], "s", torch.nn.Linear, Affine, torch.add, json.dumps, Holder]
    assert [by_value_reduce(o) for o in objects] == [None] * len(objects)
    assert by_value_reduce(local) is not None
    # decisions are cached per object: no find_spec / pickle.dumps on later calls
    monkeypatch.setattr(importlib.util, "find_spec", lambda *a: pytest.fail("find_spec called again"))
    monkeypatch.setattr(_shipping, "importable_by_reference", lambda o: pytest.fail(f"decided {o} again"))
    assert [by_value_reduce(o) for o in objects] == [None] * len(objects)
    assert by_value_reduce(local) is not None


def test_main_and_mp_main_are_one_name_on_the_wire():
    for module in ("__main__", "__mp_main__"):
        cls = type("Spawned", (), {"__module__": module})
        func, args = by_value_reduce(cls)
        assert func is _shipping._by_value and args[:2] == ("__main__", "Spawned")
        assert args[2] is None  # this process's __main__ has no Spawned: no identity, a copy
        assert pickle.loads(_dumps(cls)).__qualname__ == "Spawned"


def test_same_code_resolves_to_own_object_other_code_to_a_copy(monkeypatch):
    # A module the receiver has in sys.modules but cannot import: the identity rule in one process.
    source = "class K:\n    tag = 'first'\n"
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(source)
    mod = type(sys)("_shipping_dyn_module")
    mod.__file__ = f.name
    exec(compile(source, f.name, "exec"), mod.__dict__)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    original = mod.K
    data = _dumps([original, original()])
    assert _shipping.by_value_reduce(original)[1][2] == _shipping.fingerprint(original) is not None
    cls, instance = pickle.loads(data)
    assert cls is original and type(instance) is original
    # the receiver's object of that name is other code: the copy is used, never the other code
    other_source = "class K:\n    tag = 'second'\n"
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f2:
        f2.write(other_source)
    mod.__file__ = f2.name
    exec(compile(other_source, f2.name, "exec"), mod.__dict__)
    assert mod.K is not original
    cls, instance = pickle.loads(data)
    assert cls is not mod.K and cls.tag == "first" and type(instance) is cls
    os.unlink(f.name)
    os.unlink(f2.name)


def test_nested_non_importable_objects_in_arguments_go_by_value():
    class Cfg:
        def __init__(self, scale):
            self.scale = scale

    big = torch.arange(100_000.0)
    packed, args, kwargs = pack_constructor(Holder, ([Cfg(2.0)],), {"extra": {"cfg": Cfg(3.0), "t": big}})
    assert isinstance(packed, ByValue) and args == () and kwargs == {}
    # tensors travel beside the pickle (RPC's tensor channel), not inside it
    assert len(packed.payload) < 20_000 and len(packed.extras) == 1 and packed.extras[0] is big
    cls, args, kwargs = unpack_constructor(*pickle.loads(pickle.dumps((packed, (), {}))))
    assert cls is Holder and args[0][0].scale == 2.0 and kwargs["extra"]["cfg"].scale == 3.0
    assert torch.equal(kwargs["extra"]["t"], big)
    # importable all the way down: sent as is
    same = (Holder, ([Affine(2)],), {"extra": {"t": big}})
    assert pack_constructor(*same) is not None and pack_constructor(*same)[0] is Holder


@pytest.mark.usefixtures("rpc_world")
def test_local_class_with_an_rref_and_nested_local_objects_runs_remotely():
    import torch.distributed.rpc as rpc

    class Cfg:
        def __init__(self, scale):
            self.scale = scale

    class UsesRRef(torch.nn.Module):
        def __init__(self, rref, cfgs):
            super().__init__()
            self.value = rref.to_here()
            self.total = sum(c.scale for c in cfgs["list"])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.value * self.total

    rref = rpc.remote("worker1", torch.add, (torch.ones(2), 1.0))  # an RRef only RPC can send
    proxy = RemoteModule("worker2/cpu", UsesRRef, (rref, {"list": [Cfg(1.0), Cfg(2.0)]}))
    assert proxy(torch.ones(2)).tolist() == [6.0, 6.0]


@pytest.mark.usefixtures("rpc_world")
def test_local_class_returns_another_local_class():
    Pair = collections.namedtuple("Pair", "a b")

    class Splits(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> "Pair":
            return Pair(x, -x)

    out = RemoteModule("worker2/cpu", Splits)(torch.ones(1))
    assert out.a.tolist() == [1.0] and out.b.tolist() == [-1.0]


@pytest.mark.usefixtures("rpc_world")
def test_local_class_returns_a_local_dataclass():
    @dataclasses.dataclass
    class Stats:
        total: float
        parts: list = dataclasses.field(default_factory=list)

    class Summarises(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> "Stats":
            return Stats(float(x.sum()), [x])

    proxy = RemoteModule("worker2/cpu", Summarises)
    for out in (proxy(torch.ones(3)), proxy.forward_async(torch.ones(3)).wait()):
        assert dataclasses.is_dataclass(out) and type(out).__qualname__.endswith("Stats")
        assert out.total == 3.0 and torch.equal(out.parts[0], torch.ones(3))
        assert [f.name for f in dataclasses.fields(out)] == ["total", "parts"]


@pytest.mark.slow
def test_pickles_resolve_in_the_same_script_and_copy_in_another(tmp_path):
    """Pure pickle level, three processes with different hash seeds: tests/proxy/scripts/shipping_same.py dumps,
    tests/proxy/scripts/shipping_other.py (other code, same names) must get copies and sends results back, and
    another tests/proxy/scripts/shipping_same.py process must get its own objects, also for what came back."""
    sent, back = str(tmp_path / "sent"), str(tmp_path / "back")

    def run(seed, *argv):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": str(seed)}
        out = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=SETUP_S)
        assert out.returncode == 0, out.stderr[-3000:]
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), "RESULT null")
        return json.loads(line[len("RESULT "):])

    run(1, "tests/proxy/scripts/shipping_same.py", "dump", sent)
    other = run(2, "tests/proxy/scripts/shipping_other.py", sent, back)
    factory_error = other.pop("factory_error")
    assert other == dict.fromkeys(other, True) and len(other) == 6, other
    assert "could not be copied by its sender" in factory_error and "_thread.lock" in factory_error
    same = run(3, "tests/proxy/scripts/shipping_same.py", "load", sent, back)
    assert same.pop("main") == "__main__"
    assert same == dict.fromkeys(same, True) and len(same) == 9, same
