"""RemoteModule against the shared RPC world (worker0 = this process)."""

import inspect

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.optim import DistributedOptimizer

import remote_module.remote_module as rm_impl
from remote_module import RemoteModule
from tests._marks import GRAD_ON_WITHOUT_CONTEXT
from tests.proxy import _remote
from tests.proxy._remote import Affine, ModeReporter, Nested, VarArgs

pytestmark = [pytest.mark.usefixtures("rpc_world"), GRAD_ON_WITHOUT_CONTEXT]


def local_twin(proxy):
    """A local copy of the remote module (same weights)."""
    return proxy.get_module_rref().to_here()


def test_forward_matches_local_module():
    proxy = RemoteModule("worker1/cpu", Affine, args=(4,), kwargs={"seed": 3})
    twin = local_twin(proxy)
    x = torch.randn(5, 4)
    shift = torch.randn(4)
    assert torch.allclose(proxy(x), twin(x))
    assert torch.allclose(proxy.forward(x, 2.0, shift=shift), twin(x, 2.0, shift=shift))
    fut = proxy.forward_async(x, scale=0.5)
    assert isinstance(fut, torch.futures.Future)
    assert torch.allclose(fut.wait(), twin(x, 0.5))


def test_rank_form_and_default_device():
    by_rank = RemoteModule("rank:2/cpu", Affine)
    assert by_rank.on == "worker2" and by_rank.device == "cpu"
    by_name = RemoteModule("worker2", Affine)
    assert by_name.on == "worker2" and by_name.device == "cpu"


def test_signature_equals_the_modules():
    proxy = RemoteModule("worker1", VarArgs)
    expected = inspect.signature(VarArgs().forward)
    assert inspect.signature(proxy.forward) == expected
    assert list(inspect.signature(proxy.forward_async).parameters) == list(expected.parameters)
    out = proxy(1, 2, 3, c=4, z=5)
    assert out == {"a": 1, "b": 2, "rest": [3], "c": 4, "extra": {"z": 5}}


def test_signature_of_a_torch_module():
    proxy = RemoteModule("worker1", torch.nn.EmbeddingBag, (10, 3), {"mode": "sum"})
    assert inspect.signature(proxy.forward) == inspect.signature(torch.nn.EmbeddingBag(10, 3).forward)
    out = proxy(torch.tensor([1, 2, 4, 5]), offsets=torch.tensor([0, 2]))
    assert out.shape == (2, 3)


def test_wrong_arguments_raise_on_the_caller_without_sending(monkeypatch):
    proxy = RemoteModule("worker1", Affine)
    sent = []
    monkeypatch.setattr(rm_impl.rpc, "rpc_sync", lambda *a, **k: sent.append(a))
    monkeypatch.setattr(rm_impl.rpc, "rpc_async", lambda *a, **k: sent.append(a))
    with pytest.raises(TypeError):
        proxy(torch.ones(4), 1.0, 2.0)
    with pytest.raises(TypeError):
        proxy.forward_async(scale=1.0)
    with pytest.raises(TypeError):
        proxy.forward(torch.ones(4), bogus=1)
    assert sent == []
    monkeypatch.undo()
    # ...and the host saw no call either.
    assert rpc.rpc_sync("worker1", _remote.call_counter, (proxy.get_module_rref(),)) == 0


def test_nested_inputs_and_outputs():
    proxy = RemoteModule("worker2", Nested)
    x = torch.ones(2)
    out = proxy({"x": x, "ys": [x * 7]})
    assert isinstance(out, _remote.Pair)
    assert torch.equal(out.first, x + 1)
    assert torch.equal(out.second[0], x * 2)
    assert torch.equal(out.second[1]["y"], x * 7)


def test_not_a_module_is_a_value_error_at_construction():
    with pytest.raises(ValueError) as info:
        RemoteModule("worker1", _remote.not_a_module_factory, (2,))
    assert str(info.value).startswith(
        "Expect `module_cls(*args, **kwargs)` returns an instance of <class nn.Module>, "
        "but it returns an instance of <class 'list'>."
    )


def test_constructor_exception_surfaces_at_construction():
    with pytest.raises(ZeroDivisionError, match="constructor failed on purpose") as info:
        RemoteModule("worker1", _remote.FailsInInit)
    assert "worker1" in str(info.value) and "FailsInInit" in str(info.value)


def test_exception_in_forward_keeps_its_type():
    proxy = RemoteModule("worker1", _remote.Boom)
    with pytest.raises(KeyError, match="no such key 7"):
        proxy(7)
    with pytest.raises(KeyError, match="no such key 8"):
        proxy.forward_async(8).wait()


def test_train_and_eval_run_on_the_host_and_return_the_proxy():
    proxy = RemoteModule("worker1", ModeReporter)
    assert proxy() is True
    assert proxy.eval() is proxy
    assert proxy.training is False and proxy() is False
    assert proxy.train() is proxy
    assert proxy.training is True and proxy() is True
    assert proxy.train(False) is proxy and proxy() is False
    with pytest.raises(ValueError, match="boolean"):
        proxy.train("yes")


def test_every_proxy_of_one_module_reports_the_hosts_training_flag():
    a = RemoteModule("worker1", ModeReporter)
    b = RemoteModule.init_from_module_rref("worker1", a.get_module_rref())
    a.eval()
    assert b.training is False and a.training is False
    assert rpc.rpc_sync("worker2", _remote.training_of, (a,)) is False  # a proxy received elsewhere
    b.train()
    assert a.training is True and rpc.rpc_sync("worker2", _remote.training_of, (a,)) is True
    # `module.training = mode` sets the host module's flag, as it sets a local module's
    local = ModeReporter()
    local.training = False
    a.training = False
    assert b() is local() is False and b.training is False
    with pytest.raises(ValueError, match="boolean"):
        a.training = 1


def test_calls_never_read_training(monkeypatch):
    # reading proxy.training is a round trip: forward / forward_async must not do it
    proxy = RemoteModule("worker1", Affine)
    x = torch.randn(2, 4)
    original = RemoteModule.training

    def read(self):
        raise AssertionError("proxy.training was read")

    monkeypatch.setattr(RemoteModule, "training", property(read, original.fset))
    assert torch.equal(proxy(x), proxy.forward_async(x).wait())
    monkeypatch.undo()
    assert proxy.training is True


def test_init_from_module_rref_shares_the_module():
    a = RemoteModule("worker1/cpu", Affine)
    b = RemoteModule.init_from_module_rref("worker1/cpu", a.get_module_rref())
    assert b.get_module_rref() is a.get_module_rref() or b.get_module_rref().owner_name() == "worker1"
    x = torch.randn(2, 4)
    assert torch.equal(a(x), b(x))
    assert inspect.signature(b.forward) == inspect.signature(a.forward)
    # one module: both proxies' calls count on it
    b(x)
    assert rpc.rpc_sync("worker1", _remote.call_counter, (a.get_module_rref(),)) == 3


def test_init_from_module_rref_naming_another_worker_calls_the_owner():
    a = RemoteModule("worker1/cpu", Affine)
    x = torch.randn(2, 4)
    with pytest.warns(UserWarning, match=r"names worker 'worker2', but module_rref is owned by 'worker1'"):
        b = RemoteModule.init_from_module_rref("worker2/cpu", a.get_module_rref())
    assert b.on == "worker1" and b.device == "cpu"
    assert torch.equal(b(x), a(x)) and torch.equal(b.forward_async(x).wait(), a(x))
    # torch's own test: worker2 wraps worker1's module naming itself; the proxy comes back here
    c = rpc.rpc_sync("worker2", RemoteModule.init_from_module_rref, ("worker2", a.get_module_rref()))
    assert c.on == "worker1" and torch.equal(c(x), a(x))
    assert rpc.rpc_sync("worker1", _remote.call_counter, (a.get_module_rref(),)) == 6


def test_caller_parameters_passed_as_arguments_get_their_gradients_as_locally():
    # torch RPC sends an nn.Parameter detached (pytorch/pytorch#86525): locally a parameter
    # given to a module's forward gets its gradient, so it must here too, nested ones included
    proxy = RemoteModule("worker1", _remote.Weighted)
    x = torch.arange(1.0, 4.0)
    w, v = nn.Parameter(torch.full((3,), 2.0)), nn.Parameter(torch.full((3,), 3.0))
    local = _remote.Weighted()
    want_loss = local(x, w, (v, v))
    want = torch.autograd.grad(want_loss, [w, v])
    for run in (lambda: proxy(x, w, (v, v)), lambda: proxy.forward_async(x, w, [v, v]).wait()):
        with dist_autograd.context() as ctx:
            loss = run()
            dist_autograd.backward(ctx, [loss])
            got = dist_autograd.get_gradients(ctx)
        assert torch.equal(loss, want_loss.detach())
        assert torch.equal(got[w], want[0]) and torch.equal(got[v], want[1])
    assert isinstance(w, nn.Parameter) and w.grad is None  # the caller's objects are untouched


def test_remote_parameters_train_with_distributed_optimizer():
    proxy = RemoteModule("worker1", Affine, (4,), {"seed": 5})
    twin = local_twin(proxy)
    params = proxy.remote_parameters()
    assert len(params) == 2 and all(isinstance(p, rpc.PyRRef) for p in params)
    assert len(proxy.remote_parameters(recurse=False)) == 2
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.1)
    x = torch.randn(8, 4)
    target = torch.randn(8, 4)
    with dist_autograd.context() as ctx:
        loss = ((proxy(x) - target) ** 2).mean()
        dist_autograd.backward(ctx, [loss])
        opt.step(ctx)
    # the same step, locally
    local_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    ((twin(x) - target) ** 2).mean().backward()
    local_opt.step()
    updated = local_twin(proxy)
    assert torch.allclose(updated.weight, twin.weight, atol=1e-6)
    assert torch.allclose(updated.bias, twin.bias, atol=1e-6)
    assert not torch.allclose(updated.weight, Affine(4, seed=5).weight)


def test_host_needs_only_the_package_installed(rpc_world):
    # "bare" only called rpc.init_rpc; no test uses it before this one.
    assert rpc.rpc_sync("bare", _remote.loaded_modules, ("remote_module",)) == []
    proxy = RemoteModule("bare/cpu", Affine, (4,), {"seed": 1})
    x = torch.randn(3, 4)
    expected = Affine(4, seed=1)(x)
    assert torch.allclose(proxy.forward_async(x).wait(), expected)
    assert torch.allclose(proxy(x), expected)


def test_api_before_rpc_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(rm_impl, "is_rpc_initialized", lambda: False)
    with pytest.raises(RuntimeError, match=r"rpc\.init_rpc"):
        RemoteModule("worker1", Affine)


def test_unhashable_module():
    proxy = RemoteModule("worker1", _remote.Unhashable)
    assert torch.equal(proxy(torch.zeros(2)), torch.ones(2))
    twin = RemoteModule.init_from_module_rref("worker1", proxy.get_module_rref())
    assert twin.module_key == proxy.module_key
