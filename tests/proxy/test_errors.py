"""Errors that help: faithful remote exceptions, bad input caught on the caller, timeouts."""

import contextlib
import threading

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn

import remote_module
import remote_module.remote_module as impl
from remote_module import RemoteModule, RemoteModuleError
from tests._deadlines import HANG_S
from tests._marks import GRAD_ON_WITHOUT_CONTEXT
from tests.proxy import _held, _remote
from tests.proxy._remote import Affine, Raiser, UserError

pytestmark = [pytest.mark.usefixtures("rpc_world"), GRAD_ON_WITHOUT_CONTEXT]


@pytest.fixture(scope="module")
def raiser(rpc_world):
    return RemoteModule("worker1", Raiser)


@pytest.mark.parametrize(
    "kind,exc_type,text",
    [
        ("builtin", ValueError, "bad value inside forward"),
        ("torch", RuntimeError, "size"),
        ("user", UserError, "the user's own error"),
    ],
)
def test_remote_exception_keeps_its_type(raiser, kind, exc_type, text):
    for call in (lambda: raiser(kind), lambda: raiser.forward_async(kind).wait()):
        with pytest.raises(exc_type) as info:
            call()
        msg = str(info.value)
        assert text in msg.splitlines()[0]
        assert "worker1" in msg and "tests.proxy._remote.Raiser" in msg
        # the remote traceback includes the user's frame inside forward
        assert 'in forward' in msg and "_remote.py" in msg


def test_type_unknown_to_the_caller_becomes_a_remote_module_error(raiser):
    with pytest.raises(RemoteModuleError) as info:
        raiser("local")
    assert type(info.value).__name__ == "LocalOnlyError"
    assert "LocalOnlyError" in str(info.value) and "defined inside forward" in str(info.value)


def test_remote_module_error_is_public():
    from remote_module._core import errors as _errors

    assert "RemoteModuleError" in remote_module.__all__
    assert RemoteModuleError is _errors.RemoteModuleError and issubclass(RemoteModuleError, RuntimeError)
    # timeouts have their own public type, a RuntimeError as torch's RPC timeouts are
    assert "CallTimeout" in remote_module.__all__
    assert remote_module.CallTimeout is _errors.CallTimeout and issubclass(remote_module.CallTimeout, RuntimeError)


def test_api_before_rpc_says_what_to_call(monkeypatch):
    monkeypatch.setattr(impl, "is_rpc_initialized", lambda: False)
    with pytest.raises(RuntimeError, match=r"call rpc\.init_rpc"):
        RemoteModule("worker1", Affine)
    with pytest.raises(RuntimeError, match=r"call rpc\.init_rpc"):
        RemoteModule.init_from_module_rref("worker1", None)


def test_unsendable_arguments_are_named_on_the_caller(tmp_path):
    proxy = RemoteModule("worker1", Affine)
    with pytest.raises(TypeError, match=r"argument 'x' of tests\.proxy\._remote\.Affine\.forward cannot be sent"):
        proxy(threading.Lock())
    with open(tmp_path / "f.txt", "w") as f:
        with pytest.raises(TypeError, match=r"argument 'shift' .*cannot be sent"):
            proxy(torch.ones(4), shift=f)
        with pytest.raises(TypeError, match=r"argument 'scale' .*cannot be sent"):
            proxy.forward_async(torch.ones(4), f)
    assert torch.is_tensor(proxy(torch.ones(4)))  # the proxy still works


class Unreducible:
    """An argument whose ``__reduce__`` raises (not a pickling error type)."""

    def __reduce__(self):
        raise RuntimeError("Unreducible refuses to be pickled")


class UnreducibleTensor(torch.Tensor):
    """A tensor subclass: it travels beside the pickle, pickled by RPC's own pickler."""

    def __reduce_ex__(self, protocol):
        raise RuntimeError("UnreducibleTensor refuses to be pickled")


@pytest.mark.parametrize("path", ["inline", "non-inline"])
@pytest.mark.parametrize("make_bad", [Unreducible, lambda: torch.ones(4).as_subclass(UnreducibleTensor)],
                         ids=["object", "tensor-subclass"])
def test_an_argument_whose_reduce_raises_is_a_type_error_naming_it(path, make_bad):
    affine = RemoteModule("worker1", Affine)
    var_args = RemoteModule("worker1", _remote.VarArgs)
    x, bad = torch.ones(4), make_bad()
    calls = [
        ("scale", lambda: affine(x, bad)),
        ("scale", lambda: affine.forward_async(x, bad)),
        ("shift", lambda: affine(x, shift=bad)),
        ("x", lambda: affine.forward_async(bad)),
        ("rest[1]", lambda: var_args(1, 2, 3, bad)),  # forward(self, a, /, b, *rest, c=3, **extra)
        ("c", lambda: var_args.forward_async(1, 2, c=bad)),
        ("z", lambda: var_args(1, 2, z=bad)),
    ]
    with dist_autograd.context() if path == "non-inline" else contextlib.nullcontext():
        assert affine._fast_path_allowed() is (path == "inline")
        for name, call in calls:
            with pytest.raises(TypeError) as info:
                call()
            message = str(info.value)
            assert message.startswith(f"argument {name!r} of ") and "refuses to be pickled" in message, message
    assert rpc.rpc_sync("worker1", _remote.call_counter, (affine.get_module_rref(),)) == 0  # nothing sent
    assert torch.equal(affine(x, 0.0), torch.zeros(4))  # the proxy still works


# malformed remote_device strings and bad module_cls / args: (kwargs to RemoteModule, type, message part)
BAD_INPUTS = [
    (dict(remote_device=""), ValueError,
     "Could not parse remote_device: . The valid format is '<workername>/<device>'"),
    (dict(remote_device="/cpu"), ValueError, "Could not parse remote_device: /cpu."),
    (dict(remote_device="worker1/"), ValueError, "Could not parse remote_device: worker1/."),
    (dict(remote_device="worker1/cpu/0"), ValueError, "Could not parse remote_device: worker1/cpu/0."),
    (dict(remote_device="rank:one/cpu"), ValueError, "Could not parse remote_device: rank:one/cpu."),
    (dict(remote_device="host:1/cpu"), ValueError, "Could not parse remote_device: host:1/cpu."),
    (dict(remote_device="cuda:0"), ValueError, "Could not parse remote_device: cuda:0."),
    (dict(remote_device="cpu"), ValueError, "Could not parse remote_device: cpu."),
    (dict(remote_device="worker 1/cpu"), ValueError, "Could not parse remote_device: worker 1/cpu."),
    (dict(remote_device="worker1/gpu0"), RuntimeError, "gpu0"),
    (dict(remote_device="worker1/cuda:x"), RuntimeError, "cuda:x"),
    (dict(remote_device=7), TypeError, "remote_device must be a str"),
    (dict(remote_device="nobody/cpu"), ValueError, "names worker 'nobody', which is not in this RPC world"),
    (dict(remote_device="rank:99/cpu"), ValueError, "names rank 99, which is not in this RPC world"),
    (dict(module_cls=42), TypeError, "module_cls must be an nn.Module class or a callable"),
    (dict(module_cls=_remote.not_a_module_factory), ValueError,
     "Expect `module_cls(*args, **kwargs)` returns an instance of <class nn.Module>, "
     "but it returns an instance of <class 'list'>."),
    (dict(args=5), TypeError, "args must be a tuple"),
    (dict(kwargs=[("n", 4)]), TypeError, "kwargs must be a dict"),
    (dict(kwargs={1: 4}), TypeError, "kwargs must be a dict of str"),
    (dict(args=(1, 2, 3, 4)), TypeError, "Affine.__init__() takes from 1 to 3 positional arguments but 5 were given"),
    (dict(kwargs={"nope": 1}), TypeError, "unexpected keyword argument 'nope'"),
    (dict(module_cls=_remote.FailsInInit), ZeroDivisionError, "constructor failed on purpose"),
    (dict(timeout=0), ValueError, "timeout must be a positive number"),
    (dict(timeout="5"), ValueError, "timeout must be a positive number"),
    (dict(_module_interface_cls=Affine), ValueError, "@torch.jit.interface"),
]


@pytest.mark.parametrize("overrides,exc_type,text", BAD_INPUTS, ids=[str(i) for i in range(len(BAD_INPUTS))])
def test_bad_input_table(overrides, exc_type, text):
    call = dict(remote_device="worker1/cpu", module_cls=Affine, args=None, kwargs=None)
    call.update(overrides)
    with pytest.raises(exc_type) as info:
        RemoteModule(
            call.pop("remote_device"), call.pop("module_cls"), call.pop("args"), call.pop("kwargs"), **call
        )
    assert text in str(info.value)


def test_timeout_bounds_a_hanging_call():
    # the host holds each call until its timeout error is in (tests/proxy/_held.py): a call that
    # never times out fails the test at the hang guard
    proxy = RemoteModule("worker2", _held.Held, timeout=HANG_S)  # built with time to spare
    proxy.timeout = 1.0
    for i, call in enumerate((proxy, lambda key: proxy.forward_async(key).wait())):
        error = _held.fails_while_held(call, f"hold-errors-{i}", RuntimeError, 1.0, worker="worker2")
        assert "worker2" in str(error) and "timeout" in str(error).lower(), error
    proxy.timeout = HANG_S
    assert proxy("free") == "free"  # the proxy works after its calls timed out


def test_timeout_travels_with_the_proxy():
    import torch.distributed.rpc as rpc

    seconds = HANG_S + 0.5  # a timeout of its own, long enough to build the module at any speed
    proxy = RemoteModule("worker1", nn.Identity, timeout=seconds)
    back = rpc.rpc_sync("worker2", _remote.echo, (proxy,))
    assert back.timeout == seconds
