"""Errors met porting a local script onto a model holding a RemoteModule say what to do: the
torch idiom's call that works here, and why the one tried cannot."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from torch import nn

from remote_module import RemoteModule
from tests._marks import GRAD_ON_WITHOUT_CONTEXT

pytestmark = [pytest.mark.usefixtures("rpc_world"), GRAD_ON_WITHOUT_CONTEXT]


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 3), RemoteModule("worker1/cpu", nn.Linear, (3, 2)))


@pytest.mark.parametrize("save", [lambda m: torch.save(m, io.BytesIO()), pickle.dumps])
def test_saving_a_model_holding_a_proxy_says_to_save_its_state_dict(save):
    m = model()
    with pytest.raises(RuntimeError) as info:
        save(m)
    text = str(info.value)
    assert text.startswith("Cannot pickle RemoteModule in python pickler. RemoteModule can only be pickled "
                           "when using RPC")  # torch's words first
    assert "save model.state_dict() instead" in text and "handle" in text and "load_state_dict" in text
    # what it says works: the state_dict saves, and loads into a model built the same way
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    twin = model()
    twin.load_state_dict(torch.load(buf))
    x = torch.randn(4, 3)
    with torch.no_grad():
        assert torch.equal(twin(x), m(x))


@pytest.mark.parametrize("listing", ["parameters", "named_parameters"])
def test_the_freeze_loop_over_a_proxys_parameters_names_requires_grad_(listing):
    m = model()
    with pytest.raises(ValueError) as info:
        for _ in getattr(m[1], listing)():
            pass
    assert "proxy.requires_grad_(False)" in str(info.value)
    # what it says works: the remote module is frozen on its host
    m[1].requires_grad_(False)
    assert [r.to_here().requires_grad for r in m[1].remote_parameters()] == [False, False]
    m[1].requires_grad_(True)
