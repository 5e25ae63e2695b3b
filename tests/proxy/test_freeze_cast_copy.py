"""Freezing, casting and deep-copying a model that holds a RemoteModule do to the remote
module what local torch does to a local one (issue 41, item 12): ``requires_grad_`` of the
model (or of the proxy alone, or ``p.requires_grad = flag`` over ``model.parameters()``)
reaches the host, ``model.double()`` / ``.to(dtype)`` / ``.type(dtype)`` cast the remote
module on its host, and ``copy.deepcopy(model)`` copies it there. Each is compared with the
same local module given the same calls (exact equality)."""

import copy

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.optim import DistributedOptimizer

from remote_module import RemoteModule
from tests._marks import GRAD_ON_WITHOUT_CONTEXT
from tests.proxy._remote import HoldsLock, LinearNorm, tensor_views

pytestmark = [pytest.mark.usefixtures("rpc_world"), GRAD_ON_WITHOUT_CONTEXT]


def host_views(proxy):
    """(class, dtype, requires_grad) of every parameter and buffer of the proxy's module."""
    return rpc.rpc_sync(proxy.on, tensor_views, (proxy.get_module_rref(),))


def local_views(module):
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return {name: (type(t).__name__, str(t.dtype), t.requires_grad) for name, t in tensors}


def pair(module_cls=nn.Linear, args=(4, 3)):
    """A proxy on worker1 and a local module with the same state."""
    proxy = RemoteModule("worker1/cpu", module_cls, args)
    local = module_cls(*args)
    local.load_state_dict(proxy.state_dict())
    return proxy, local


def assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key


# ---- freezing ---------------------------------------------------------------------------


def test_a_models_requires_grad_reaches_the_remote_module():
    proxy, local = pair()
    model, reference = nn.Sequential(proxy, nn.Tanh()), nn.Sequential(local, nn.Tanh())
    assert model.requires_grad_(False) is model
    reference.requires_grad_(False)
    assert host_views(proxy) == local_views(local)
    assert not any(p.requires_grad for p in model.parameters())
    model.requires_grad_()
    reference.requires_grad_()
    assert host_views(proxy) == local_views(local)


def test_a_frozen_remote_layer_is_not_trained_and_the_rest_is():
    proxy, local = pair()
    torch.manual_seed(1)
    model = nn.Sequential(proxy, nn.Linear(3, 2))
    reference = nn.Sequential(local, nn.Linear(3, 2))
    reference[1].load_state_dict(model[1].state_dict())
    model.requires_grad_(False)
    model[1].requires_grad_(True)
    reference.requires_grad_(False)
    reference[1].requires_grad_(True)
    x = torch.randn(5, 4)
    head_before = model[1].weight.detach().clone()
    opt = DistributedOptimizer(
        torch.optim.SGD, [rpc.RRef(p) for p in model.parameters()] + proxy.remote_parameters(), lr=0.5
    )
    with dist_autograd.context() as ctx:
        dist_autograd.backward(ctx, [model(x).square().sum()])
        opt.step(ctx)
    local_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    reference(x).square().sum().backward()
    local_opt.step()
    assert_same_state(model, reference)  # the remote layer as it was, the head stepped
    assert not torch.equal(model[1].weight, head_before)


def test_requires_grad_set_over_the_models_parameters_reaches_the_host_by_the_next_forward():
    proxy, local = pair()
    model = nn.Sequential(proxy)
    for p in model.parameters():
        p.requires_grad = False
    for p in local.parameters():
        p.requires_grad = False
    x = torch.randn(2, 4)
    out = model(x)
    assert host_views(proxy) == local_views(local)
    assert out.requires_grad is local(x).requires_grad is False


def test_a_proxy_alone_is_frozen_on_its_host():
    proxy, local = pair()
    assert proxy.requires_grad_(False) is proxy
    local.requires_grad_(False)
    assert host_views(proxy) == local_views(local)
    proxy.requires_grad_()
    local.requires_grad_()
    assert host_views(proxy) == local_views(local)
    with pytest.raises(TypeError, match="requires_grad must be a bool"):
        proxy.requires_grad_("no")
    assert host_views(proxy) == local_views(local)  # refused: nothing changed


# ---- casting ----------------------------------------------------------------------------

CASTS = {
    "double": lambda m: m.double(),
    "to(float64)": lambda m: m.to(torch.float64),
    "to(cpu, float64)": lambda m: m.to("cpu", torch.float64),
    "type(float64)": lambda m: m.type(torch.float64),  # casts the int64 buffer too, as torch does
    "double().float()": lambda m: m.double().float(),
    "half().float()": lambda m: m.half().float(),
}


@pytest.mark.parametrize("cast", list(CASTS))
def test_casting_a_model_casts_the_remote_module_as_torch_casts_a_local_one(cast):
    proxy, local = pair(LinearNorm, (4, 3))
    model, reference = nn.Sequential(proxy, nn.Linear(3, 2)), nn.Sequential(local, nn.Linear(3, 2))
    reference[1].load_state_dict(model[1].state_dict())
    assert CASTS[cast](model) is model
    CASTS[cast](reference)
    assert host_views(proxy) == local_views(local)
    x = torch.randn(6, 4).to(local.linear.weight.dtype)
    out, expected = model(x), reference(x)
    assert out.dtype == expected.dtype and torch.equal(out, expected)
    assert_same_state(model, reference)  # running stats included


def test_moving_a_model_leaves_the_remote_module_where_remote_device_put_it():
    proxy, local = pair()
    model = nn.Sequential(proxy)
    assert model.to("cpu") is model and model.cpu() is model
    assert host_views(proxy) == local_views(local)
    assert proxy.device == "cpu"


def test_a_cast_proxy_sent_over_rpc_keeps_its_state():
    proxy, _ = pair()
    nn.Sequential(proxy).double()
    x = torch.randn(2, 4, dtype=torch.float64)
    assert torch.equal(rpc.rpc_sync("worker2", _forward, (proxy, x)), proxy(x))


def _forward(proxy, x):
    return proxy(x)


# ---- deepcopy ---------------------------------------------------------------------------


def test_deepcopy_copies_the_remote_module_on_its_host():
    proxy, local = pair(LinearNorm, (4, 3))
    model = nn.Sequential(proxy, nn.Linear(3, 2))
    clone = copy.deepcopy(model)
    assert clone[0] is not proxy and isinstance(clone[0], RemoteModule) and clone[0].on == proxy.on
    assert clone[0].get_module_rref() != proxy.get_module_rref()
    assert_same_state(clone, model)
    x = torch.randn(6, 4)
    assert torch.equal(clone(x), model(x))
    # independent, as a local deepcopy: changing the copy leaves the original alone
    before = {k: v.clone() for k, v in model.state_dict().items()}
    clone.load_state_dict({k: torch.zeros_like(v) for k, v in clone.state_dict().items()})
    clone[0].requires_grad_(False)
    clone.double()
    after = model.state_dict()
    assert all(torch.equal(after[k], before[k]) and after[k].dtype == before[k].dtype for k in before)
    assert host_views(proxy) == local_views(local)
    assert all(not torch.any(v) for v in clone.state_dict().values())


def test_deepcopy_keeps_what_is_shared_shared():
    proxy = RemoteModule("worker1/cpu", nn.Linear, (4, 4))
    second = RemoteModule.init_from_module_rref("worker1/cpu", proxy.get_module_rref())
    model = nn.ModuleList([proxy, proxy, second])
    clone = copy.deepcopy(model)
    assert clone[0] is clone[1] and clone[2] is not clone[0]
    # one module on the host behind both copies (as local deepcopy keeps one copy of a shared layer)
    clone[0].load_state_dict({"weight": torch.zeros(4, 4), "bias": torch.ones(4)})
    assert torch.equal(clone[2].state_dict()["bias"], torch.ones(4))
    assert not torch.equal(proxy.state_dict()["bias"], torch.ones(4))


def test_deepcopy_carries_frozen_and_cast_state():
    proxy, local = pair()
    model = nn.Sequential(proxy).double().requires_grad_(False)
    clone = copy.deepcopy(model)
    local.double().requires_grad_(False)
    assert host_views(clone[0]) == local_views(local)
    x = torch.randn(2, 4, dtype=torch.float64)
    assert torch.equal(clone(x), local(x))


def test_deepcopy_of_a_module_that_cannot_be_copied_says_so():
    proxy = RemoteModule("worker1/cpu", HoldsLock, (2, 2))
    with pytest.raises(TypeError) as info:
        copy.deepcopy(nn.Sequential(proxy))
    text = str(info.value)
    assert "copy.deepcopy" in text and "worker1" in text and "HoldsLock" in text and "lock" in text
    assert proxy(torch.ones(1, 2)).shape == (1, 2)


# ---- layers made of proxies: a pipeline's stages ------------------------------------------


def test_a_model_holding_a_pipeline_freezes_and_casts_its_stages():
    from remote_module.pipeline import split_sequential

    torch.manual_seed(2)
    local = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    pipe = split_sequential(copy.deepcopy(local), ["worker1/cpu", "worker2/cpu"], chunks=2)
    model, reference = nn.Sequential(pipe), nn.Sequential(local)
    model.requires_grad_(False)
    reference.requires_grad_(False)
    assert [host_views(stage) for stage in pipe.stages] == [local_views(local[:2]), local_views(local[2:])]
    for p in model.parameters():  # set as attributes: applied by the pipeline's next forward
        p.requires_grad = True
    reference.requires_grad_(True)
    model.double()
    reference.double()
    x = torch.randn(6, 4, dtype=torch.float64)
    with dist_autograd.context():
        out = model(x)
    # (per micro-batch, as the pipeline runs it: a matmul of 3 rows and one of 6 may round
    # differently, by the kernel the CPU's BLAS picks for each shape)
    expected = torch.cat([reference(part) for part in torch.tensor_split(x, 2)])
    assert out.dtype == expected.dtype == torch.float64 and torch.equal(out, expected)
    assert [host_views(stage) for stage in pipe.stages] == [local_views(local[:2]), local_views(local[2:])]


def test_a_scriptable_proxy_is_frozen_cast_and_copied_on_its_host():
    from tests.proxy._torchscript_remote import MyModule, MyModuleInterface

    proxy = RemoteModule("worker1/cpu", MyModule, (1,), _module_interface_cls=MyModuleInterface)
    holder = nn.ModuleList([proxy])
    holder.requires_grad_(False)
    assert host_views(proxy) == {"param1": ("Parameter", "torch.float32", False)}
    holder.double()
    assert host_views(proxy) == {"param1": ("Parameter", "torch.float64", False)}
    x = torch.ones(2, dtype=torch.float64)
    assert torch.equal(proxy(x, 1)[2], x + 1)
    clone = copy.deepcopy(holder)
    flags = {name: view[1:] for name, view in host_views(clone[0]).items()}  # dtype, requires_grad
    assert clone[0].is_scriptable and flags == {"param1": ("torch.float64", False)}
    clone.float()  # independent: the copy is cast, the original is not
    assert clone[0](x.float(), 1)[2].dtype == torch.float32 and proxy(x, 1)[2].dtype == torch.float64
    assert host_views(proxy) == {"param1": ("Parameter", "torch.float64", False)}
