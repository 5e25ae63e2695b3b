"""Every unsupported nn.Module method raises torch's ValueError, from one table."""

import pytest
import torch

from remote_module import UNSUPPORTED_METHODS, RemoteModule
from remote_module._proxy.unsupported import EMPTY_WITHOUT_RECURSION
from tests.proxy._remote import Affine

pytestmark = pytest.mark.usefixtures("rpc_world")

ARGS = {
    "register_buffer": ("b", torch.ones(1)),
    "register_parameter": ("p", None),
    "add_module": ("m", None),
    "type": (torch.float64,),
    "register_backward_hook": (print,),
    "register_full_backward_hook": (print,),
    "register_full_backward_pre_hook": (print,),
    "register_forward_pre_hook": (print,),
    "register_forward_hook": (print,),
    "register_state_dict_pre_hook": (print,),
    "register_load_state_dict_post_hook": (print,),
    "apply": (print,),
    "load_state_dict": ({},),
}


@pytest.fixture(scope="module")
def proxy(rpc_world):
    return RemoteModule("worker1", Affine)


def test_table_covers_torchs_list():
    required = {
        "register_buffer", "register_parameter", "add_module", "cuda", "cpu", "ipu", "xpu", "type",
        "float", "double", "half", "bfloat16", "to", "register_backward_hook",
        "register_forward_pre_hook", "register_forward_hook", "parameters", "named_parameters",
        "buffers", "named_buffers", "zero_grad", "share_memory",
    }
    assert required <= set(UNSUPPORTED_METHODS)
    # torch's RemoteModule refuses requires_grad_; this one applies it on the host, as a local
    # module does (tests/proxy/test_freeze_cast_copy.py)
    assert "requires_grad_" not in UNSUPPORTED_METHODS


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_METHODS))
def test_unsupported_method_raises(proxy, name):
    with pytest.raises(ValueError) as info:
        result = getattr(proxy, name)(*ARGS.get(name, ()))
        if hasattr(result, "__next__"):
            next(result)
    expected = f"Method ``{name}`` not supported for RemoteModule"
    assert str(info.value).startswith(expected)
    if name == "parameters":
        assert str(info.value).startswith(expected + ". Please use ``remote_parameters`` instead.")  # torch's
        assert "proxy.requires_grad_(False)" in str(info.value)  # the freeze idiom's call


@pytest.mark.parametrize("name", EMPTY_WITHOUT_RECURSION)
def test_listing_the_proxy_alone_yields_nothing(proxy, name):
    # DDP asks every submodule for named_parameters(recurse=False) and friends
    assert list(getattr(proxy, name)(recurse=False)) == []
    if name.startswith("named_"):
        assert list(getattr(proxy, name)("prefix", False)) == []
    with pytest.raises(ValueError, match=f"Method ``{name}`` not supported"):
        getattr(proxy, name)(recurse=True)
    with pytest.raises(TypeError):
        getattr(proxy, name)(recurse=False, bogus=1)
