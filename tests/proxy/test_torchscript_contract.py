"""Scriptable proxies keep the call contract where they can: from Python, ``timeout=`` and
exceptions with their own type naming worker and module; from TorchScript, ``timeout=`` (each
call is one rpc_async with the proxy's timeout) and the host's message in TorchScript's error."""


import contextlib

import pytest
import torch

from remote_module import RemoteModule
from remote_module._proxy.codegen import template_text
from tests._deadlines import HANG_S
from tests._faults.script_gate import Gate, GateInterface, call_gate, call_gate_async
from tests.proxy import _held

pytestmark = [pytest.mark.usefixtures("rpc_world"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

TIMEOUT = 1.0


@pytest.fixture(scope="module")
def gate(rpc_world):
    # calls that must be answered get HANG_S (a hang guard); held ones get TIMEOUT (short_timeout)
    return RemoteModule("worker1", Gate, _module_interface_cls=GateInterface, timeout=HANG_S)


@contextlib.contextmanager
def short_timeout(proxy):
    """``proxy`` with TIMEOUT for the calls made (or the scripted copies made) inside."""
    proxy.timeout = TIMEOUT
    try:
        yield proxy
    finally:
        proxy.timeout = HANG_S


def held_call_fails_in_time(call, key):
    """Run ``call(key)`` against a host that holds it until the error is in; return the error,
    checking it came after the timeout, while the host still held the call (tests/proxy/_held.py)."""
    return _held.fails_while_held(call, key, Exception, TIMEOUT)


def test_python_calls_raise_the_modules_exception_type_naming_worker_and_module(gate):
    assert gate("fine") == "fine" and gate.forward_async("async").wait() == "async"
    for call in (lambda: gate("bad"), lambda: gate.forward_async("bad").wait()):
        with pytest.raises(ValueError) as info:
            call()
        text = str(info.value)
        assert text.splitlines()[0] == "the key must not be 'bad'"
        assert "worker1" in text and "tests._faults.script_gate.Gate" in text


def test_python_calls_to_a_hung_host_fail_within_the_timeout_naming_the_worker(gate):
    with short_timeout(gate):
        for i, call in enumerate((gate.forward, lambda key: gate.forward_async(key).wait())):
            error = held_call_fails_in_time(call, f"hold-py-{i}")
            assert isinstance(error, RuntimeError) and "worker1" in str(error) and f"{TIMEOUT:g} s" in str(error)
    assert gate("after") == "after"


def test_script_calls_honour_the_timeout(gate):
    scripted = torch.jit.script(gate)
    assert call_gate(scripted, "fine") == "fine" and call_gate_async(scripted, "fine") == "fine"
    with short_timeout(gate):
        scripted = torch.jit.script(gate)  # a copy: it keeps the timeout the proxy has now
    assert scripted.timeout == TIMEOUT
    for i, call in enumerate((call_gate, call_gate_async)):
        error = held_call_fails_in_time(lambda key: call(scripted, key), f"hold-script-{i}")
        assert type(error) is RuntimeError and "timeout" in str(error).lower()


def test_script_calls_carry_the_hosts_message(gate):
    scripted = torch.jit.script(gate)
    with pytest.raises(RuntimeError, match="the key must not be 'bad'"):
        call_gate(scripted, "bad")


def test_the_agents_default_timeout_is_minus_one_in_script(rpc_world):
    proxy = RemoteModule("worker2", Gate, _module_interface_cls=GateInterface)
    assert proxy.timeout == -1.0 and isinstance(proxy.timeout, float)
    assert call_gate(torch.jit.script(proxy), "default") == "default"


def test_templates_come_from_the_tree_the_package_was_imported_from():
    import remote_module

    root = __import__("pathlib").Path(remote_module.__file__).resolve().parent.parent
    assert template_text("scriptable_forward.py.tpl") == (root / "templates" / "scriptable_forward.py.tpl").read_text()


def test_capture_reads_the_type_a_script_raised():
    from remote_module._core.errors import capture

    scripted = torch.jit.script(Gate())
    try:
        scripted("bad")
    except torch.jit.Error as exc:
        failure = capture(exc)
    assert (failure.type_module, failure.type_qualname) == ("builtins", "ValueError")
    assert failure.message == "the key must not be 'bad'" and "TorchScript" in failure.traceback
    other = capture(torch.jit.Error("raised by Python code"))  # not the record torch kept
    assert (other.type_qualname, other.message) == ("Error", "raised by Python code")
