"""Host-side loading at a prefix (remote_module._proxy.state_dict), without RPC: what a proxy's host
reports equals what the same module inside a local model reports."""

from collections import OrderedDict

import pytest
import torch
from torch import nn

from remote_module._proxy.state_dict import entries_under, load_at


def _model(inner: nn.Module) -> nn.Module:
    return nn.ModuleDict({"enc": nn.Sequential(nn.Linear(2, 2), inner)})


def test_entries_under_keep_full_keys_and_their_metadata():
    sd = OrderedDict({"enc.1.weight": 1, "enc.10.weight": 2, "enc.1.sub.bias": 3})
    sd._metadata = {"": {"version": 1}, "enc.1": {"version": 2}, "enc.1.sub": {"version": 3}, "enc.10": {}}
    state, metadata = entries_under(sd, "enc.1.")
    assert list(state) == ["enc.1.weight", "enc.1.sub.bias"]
    assert dict(metadata) == {"enc.1": {"version": 2}, "enc.1.sub": {"version": 3}}


@pytest.mark.parametrize("assign", [False, True])
def test_load_at_reports_what_the_module_inside_a_model_reports(assign):
    torch.manual_seed(0)
    model = _model(nn.Embedding(4, 3))
    host = nn.Embedding(4, 3)
    sd = model.state_dict()
    sd["enc.1.weight"] = torch.zeros(5, 3)
    sd["enc.1.bogus"] = torch.zeros(1)
    with pytest.raises(RuntimeError) as info:
        model.load_state_dict(sd, strict=False, assign=assign)
    missing, unexpected, errors = load_at(host, *entries_under(sd, "enc.1."), "enc.1.", assign)
    assert (missing, unexpected) == ([], ["enc.1.bogus"])
    assert str(info.value) == "Error(s) in loading state_dict for ModuleDict:\n\t" + "\n\t".join(errors)
    assert errors[0].startswith("size mismatch for enc.1.weight:")


def test_load_at_assigns_like_load_state_dict():
    host, local = nn.Linear(2, 2), nn.Linear(2, 2)
    sd = {"weight": torch.ones(2, 2, dtype=torch.float64), "bias": torch.ones(2, dtype=torch.float64)}
    local.load_state_dict(sd, assign=True)
    assert load_at(host, {"m." + k: v for k, v in sd.items()}, {}, "m.", assign=True) == ([], [], [])
    assert host.weight.dtype == local.weight.dtype == torch.float64
    assert host.weight.requires_grad and isinstance(host.weight, nn.Parameter)


class _RaisesWhileLoading(nn.Linear):
    def _load_from_state_dict(self, *args, **kwargs):
        raise RuntimeError("this module refuses to load")


def test_a_runtime_error_raised_while_loading_is_one_message():
    assert load_at(_RaisesWhileLoading(1, 1), {}, {}, "x.") == ([], [], ["this module refuses to load"])
    with pytest.raises(ValueError, match="end with '.'"):
        load_at(nn.Linear(1, 1), {}, {}, "x")
