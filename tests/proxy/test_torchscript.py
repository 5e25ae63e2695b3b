"""Scriptable proxies: `_module_interface_cls`, torch.jit.script(proxy), calls from script."""

import inspect
import io

import pytest
import torch
import torch.distributed.rpc as rpc

from remote_module import RemoteModule
from tests._deadlines import SETUP_S
from tests._marks import GRAD_ON_WITHOUT_CONTEXT
from tests.proxy import _remote
from tests.proxy._torchscript_remote import (
    MyModule,
    MyModuleInterface,
    NestedInterface,
    NestedModule,
    run_forward,
    run_forward_async,
)

pytestmark = [pytest.mark.usefixtures("rpc_world"), pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              GRAD_ON_WITHOUT_CONTEXT]


@pytest.fixture(scope="module")
def scriptable(rpc_world):
    return RemoteModule("worker1/cpu", MyModule, (1,), {"first_kwarg": 2}, _module_interface_cls=MyModuleInterface)


def test_scriptable_proxy_runs_eagerly(scriptable):
    assert scriptable.is_scriptable
    word, number, t = scriptable(torch.ones(2), 2)
    assert (word, number) == ("default", 2) and torch.equal(t, torch.full((2,), 2.0))
    word, number, t = scriptable.forward_async(torch.zeros(1), 5, "w").wait()
    assert (word, number) == ("w", 5) and torch.equal(t, torch.ones(1))
    assert list(inspect.signature(scriptable.forward).parameters) == ["tensor", "number", "word"]


def test_script_the_proxy_and_call_from_script(scriptable):
    scripted = torch.jit.script(scriptable)
    assert scripted.training is True  # the scripted proxy's own flag, as torch's has
    assert run_forward(scripted, torch.ones(1)) == ("3", 2, torch.full((1,), 2.0))
    word, number, t = run_forward_async(scripted, torch.ones(1))
    assert (word, number) == ("3", 2) and torch.equal(t, torch.full((1,), 2.0))


def test_nested_types_in_script():
    proxy = RemoteModule("worker2", NestedModule, _module_interface_cls=NestedInterface)
    scripted = torch.jit.script(proxy)
    xs, d = scripted.forward([torch.ones(1), torch.ones(2)], {"a": torch.zeros(1)})
    assert [x.tolist() for x in xs] == [[2.0], [2.0, 2.0]] and d["a"].tolist() == [1.0]


def test_scripted_proxy_cannot_travel_and_says_what_to_do(scriptable):
    scripted = torch.jit.script(scriptable)
    with pytest.raises(RuntimeError, match="init_from_module_rref"):
        rpc.rpc_sync("worker2", _remote.echo, (scripted,))


def test_module_rref_travels_and_is_rewrapped(scriptable):
    twin = RemoteModule.init_from_module_rref(
        "worker1/cpu", scriptable.get_module_rref(), _module_interface_cls=MyModuleInterface
    )
    assert twin.is_scriptable
    scripted = torch.jit.script(twin)
    assert run_forward(scripted, torch.zeros(1)) == ("3", 2, torch.ones(1))


def test_bad_interface_is_rejected():
    with pytest.raises(ValueError, match="@torch.jit.interface"):
        RemoteModule("worker1", MyModule, (1,), _module_interface_cls=MyModule)


def test_saving_a_scripted_proxy_says_it_only_travels_over_rpc(scriptable):
    # torch's message, from the script object's own __getstate__ (before: a generic error
    # saying the object has no __getstate__)
    scripted = torch.jit.script(scriptable)
    for save in (torch.save, torch.jit.save):
        with pytest.raises(torch.jit.Error, match="RemoteModule can only be pickled when using RPC"):
            save(scripted, io.BytesIO())


def test_our_script_module_reducer_wins_whatever_the_import_order():
    # torch.distributed.nn registers its own reducer for script modules (without our advice) and
    # torch keeps the first registration: importing it before remote_module must not win.
    import subprocess
    import sys

    code = (
        "import torch.distributed.nn, torch.distributed.optim\n"
        "import remote_module\n"
        "from torch.distributed.rpc.internal import _internal_rpc_pickler as p\n"
        "from remote_module._proxy.pickling import reduce_script_module\n"
        "print(p._class_reducer_dict[torch.jit.RecursiveScriptModule] is reduce_script_module)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=SETUP_S)
    assert out.stdout.strip() == "True", out.stderr[-2000:]
