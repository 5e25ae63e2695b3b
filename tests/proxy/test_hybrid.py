"""A model holding RemoteModules behaves like any model: traversal, casting, modes, repr,
state_dict checkpoints."""

import io

import pytest
import torch
import torch.distributed.rpc as rpc
from torch import nn

from remote_module import RemoteModule
from tests._marks import GRAD_ON_WITHOUT_CONTEXT
from tests.proxy import _remote
from tests.proxy._remote import Affine, Hybrid, ModeReporter

pytestmark = [pytest.mark.usefixtures("rpc_world"), GRAD_ON_WITHOUT_CONTEXT]

IDS = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9])
OFFSETS = torch.tensor([0, 4])


def remote_bag(seed=None):
    if seed is not None:
        torch.manual_seed(seed)
    return RemoteModule("worker1/cpu", nn.EmbeddingBag, (10, 4), {"mode": "sum"})


def test_proxy_is_a_leaf():
    proxy = RemoteModule("worker1", Affine)
    assert list(proxy.children()) == [] and list(proxy.named_children()) == []
    assert list(proxy.modules()) == [proxy]
    assert list(proxy.named_modules()) == [("", proxy)]
    seen = []
    assert proxy.apply(seen.append) is proxy
    assert seen == [proxy]


def test_hybrid_model_traversal_and_casting():
    model = Hybrid(remote_bag())
    local = [p for _, p in model.mlp.named_parameters()]
    handle = model.embedding.remote_requires_grad  # the proxy's zero-element requires_grad handle
    assert [id(p) for p in model.parameters()] == [id(handle)] + [id(p) for p in local]
    assert handle.numel() == 0 and handle.requires_grad and handle.grad is None
    assert [n for n, _ in model.named_parameters()] == [
        "embedding.remote_requires_grad", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias"
    ]
    assert list(model.embedding.named_parameters(recurse=False)) == []  # what DDP asks each module
    assert [n for n, _ in model.named_buffers()] == ["scale"]
    assert ("embedding", model.embedding) in list(model.named_modules())
    out = model(IDS, OFFSETS)
    out.sum().backward()
    assert model.mlp[0].weight.grad is not None
    model.zero_grad()
    assert model.mlp[0].weight.grad is None
    assert model.to(torch.float64) is model
    assert model.mlp[0].weight.dtype == torch.float64 and model.scale.dtype == torch.float64
    model.float()
    model.half()
    assert model.mlp[0].weight.dtype == torch.float16
    model.float()
    model.requires_grad_(False)
    assert not any(p.requires_grad for p in model.parameters())
    visited = []
    model.apply(lambda m: visited.append(type(m).__name__))
    assert "RemoteModule" in visited and visited[-1] == "Hybrid"
    # the casts reached the remote module on its host (float64, half, back to float32), and
    # requires_grad_ froze it; it stayed on worker1's cpu (tests/proxy/test_freeze_cast_copy.py)
    assert model.embedding.state_dict()["weight"].dtype == torch.float32
    assert model.embedding.device == "cpu" and not model.embedding.remote_trainable
    assert model(IDS, OFFSETS).dtype == torch.float32


def test_train_and_eval_reach_the_host():
    model = nn.Sequential(RemoteModule("worker2", ModeReporter))
    model.eval()
    assert model[0]() is False and model[0].training is False
    model.train()
    assert model[0]() is True


def test_repr_without_round_trip(monkeypatch):
    bag = remote_bag()
    expected = "RemoteModule(on=worker1, device=cpu, module=EmbeddingBag(10, 4, mode='sum'))"
    import remote_module.remote_module as impl

    monkeypatch.setattr(impl.rpc, "rpc_sync", lambda *a, **k: pytest.fail("repr made an RPC"))
    assert repr(bag) == expected
    model = Hybrid(bag)
    text = repr(model)
    assert text.startswith("Hybrid(\n  (embedding): " + expected + "\n  (mlp): Sequential(")


def test_state_dict_round_trip_through_torch_save():
    model = Hybrid(remote_bag(seed=1))
    sd = model.state_dict()
    assert set(sd) == {"scale", "embedding.weight", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias"}
    assert sd["embedding.weight"].device.type == "cpu"
    assert "embedding" in sd._metadata
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)

    fresh = Hybrid(remote_bag(seed=2))
    assert not torch.allclose(fresh(IDS, OFFSETS), model(IDS, OFFSETS))
    result = fresh.load_state_dict(torch.load(buf), strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert torch.equal(fresh(IDS, OFFSETS), model(IDS, OFFSETS))


def test_load_state_dict_missing_and_unexpected_keys():
    model = Hybrid(remote_bag())
    sd = model.state_dict()
    del sd["embedding.weight"]
    sd["embedding.bogus"] = torch.zeros(1)
    with pytest.raises(RuntimeError) as info:
        model.load_state_dict(sd, strict=True)
    assert 'Missing key(s) in state_dict: "embedding.weight"' in str(info.value)
    assert 'Unexpected key(s) in state_dict: "embedding.bogus"' in str(info.value)
    result = model.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["embedding.weight"]
    assert result.unexpected_keys == ["embedding.bogus"]


def test_load_state_dict_size_mismatch_is_reported():
    model = Hybrid(remote_bag())
    sd = model.state_dict()
    sd["embedding.weight"] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match="size mismatch"):
        model.load_state_dict(sd)


def test_proxy_alone_loads_its_own_state():
    a, b = remote_bag(seed=3), remote_bag(seed=4)
    assert b.load_state_dict(a.state_dict()).missing_keys == []
    assert torch.equal(a(IDS, OFFSETS), b(IDS, OFFSETS))


def test_whole_model_pickling_still_refuses():
    with pytest.raises(RuntimeError, match="only be pickled when using RPC"):
        torch.save(Hybrid(remote_bag()), io.BytesIO())


@pytest.mark.parametrize("method", ["to", "cuda", "cpu", "half", "float", "parameters", "zero_grad", "buffers"])
def test_direct_calls_on_the_proxy_still_raise_with_advice(method):
    with pytest.raises(ValueError) as info:
        getattr(remote_bag(), method)()
    text = str(info.value)
    assert text.startswith(f"Method ``{method}`` not supported for RemoteModule. ")
    assert len(text) > len(f"Method ``{method}`` not supported for RemoteModule. ") + 10


def _load_error(model, sd, strict):
    with pytest.raises(RuntimeError) as info:
        model.load_state_dict(sd, strict=strict)
    return str(info.value)


@pytest.mark.parametrize("strict", [True, False])
def test_load_state_dict_errors_name_full_keys_as_a_local_model_does(strict):
    # the remote part's errors name "enc.embedding.weight", not "weight" inside a nested summary
    model = nn.ModuleDict({"enc": Hybrid(remote_bag())})
    local = nn.ModuleDict({"enc": Hybrid(nn.EmbeddingBag(10, 4, mode="sum"))})
    sd = model.state_dict()
    sd["enc.embedding.weight"] = torch.zeros(3, 3)
    sd["enc.embedding.bogus"] = torch.zeros(1)
    del sd["enc.mlp.0.bias"]
    text = _load_error(model, sd, strict)
    assert text == _load_error(local, sd, strict)
    assert "size mismatch for enc.embedding.weight: copying a param with shape torch.Size([3, 3])" in text
    assert ('Unexpected key(s) in state_dict: "enc.embedding.bogus"' in text) is strict


def test_load_state_dict_errors_of_the_proxy_alone():
    proxy, local = remote_bag(), nn.EmbeddingBag(10, 4, mode="sum")
    sd = {"weight": torch.zeros(2, 4)}
    text = _load_error(proxy, sd, True)
    assert text.startswith("Error(s) in loading state_dict for RemoteModule:\n\tsize mismatch for weight:")
    assert text.split("\n", 1)[1] == _load_error(local, sd, True).split("\n", 1)[1]  # one summary, torch's lines


def test_load_state_dict_assign_as_a_local_model_does():
    # assign=True: the host's parameters take the loaded tensors' dtype (here float64), keeping
    # requires_grad from the old parameters, as on a local model; without it they are copied into
    model = nn.Sequential(RemoteModule("worker1", nn.Linear, (3, 2)))
    local = nn.Sequential(nn.Linear(3, 2))
    sd = {"0.weight": torch.randn(2, 3, dtype=torch.float64), "0.bias": torch.randn(2, dtype=torch.float64)}
    proxy = model[0]
    model.load_state_dict(sd, assign=False)
    assert rpc.rpc_sync("worker1", _remote.tensor_views, (proxy.get_module_rref(),))["weight"][1] == "torch.float32"
    assert model.load_state_dict(sd, assign=True).missing_keys == []
    local.load_state_dict(sd, assign=True)
    views = rpc.rpc_sync("worker1", _remote.tensor_views, (proxy.get_module_rref(),))
    assert views == {name: (type(t).__name__, str(t.dtype), t.requires_grad) for name, t in local[0].named_parameters()}
    assert views["weight"] == ("Parameter", "torch.float64", True)
    x = torch.randn(4, 3, dtype=torch.float64)
    assert torch.equal(model(x), local(x))
    # the proxy alone, too
    alone = RemoteModule("worker2", nn.Linear, (3, 2))
    alone.load_state_dict({"weight": sd["0.weight"], "bias": sd["0.bias"]}, assign=True)
    assert torch.equal(alone(x), local(x))
