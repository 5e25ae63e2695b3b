"""Subclasses of RemoteModule declare extra attributes that travel with the proxy:
``PICKLED_ATTRIBUTES = RemoteModule.PICKLED_ATTRIBUTES + ("extra",)``."""

import warnings

import pytest
import torch
import torch.distributed.rpc as rpc

import remote_module
from remote_module import RemoteModule
from tests._faults import gates
from tests.proxy._remote import Affine
from tests.proxy._subclass_remote import LabelledRemoteModule

pytestmark = pytest.mark.usefixtures("rpc_world")


def test_the_base_tuple_is_the_class_attribute_and_stays_the_base():
    assert RemoteModule.PICKLED_ATTRIBUTES is remote_module.PICKLED_ATTRIBUTES
    assert "label" not in remote_module.PICKLED_ATTRIBUTES
    assert LabelledRemoteModule.PICKLED_ATTRIBUTES == remote_module.PICKLED_ATTRIBUTES + ("label",)


def test_a_declared_attribute_travels_to_a_third_worker():
    proxy = LabelledRemoteModule("worker1/cpu", Affine, (4,), {"seed": 6}, label="shard-3")
    x = torch.randn(2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an attribute that is not sent would warn
        label, out = rpc.rpc_sync("worker2", gates.attribute_and_output, (proxy, "label", x))
    assert label == "shard-3"
    assert torch.allclose(out, Affine(4, seed=6)(x))
    back = rpc.rpc_sync("worker2", gates.attribute, (proxy, "__class__"))
    assert back is LabelledRemoteModule


def test_the_base_class_still_sends_only_its_own_attributes():
    proxy = RemoteModule("worker1/cpu", Affine)
    proxy.label = "local only"
    with pytest.warns(RuntimeWarning, match="'label'.*RemoteModule.PICKLED_ATTRIBUTES"):
        arrived = rpc.rpc_sync("worker2", gates.attribute_names, (proxy,))
    assert "label" not in arrived and "on" in arrived


def test_an_undeclared_attribute_is_rejected_with_how_to_declare_it():
    class Undeclared(RemoteModule):
        def __init__(self, *args, **kwargs):
            self.extra = 1
            super().__init__(*args, **kwargs)

    with pytest.raises(
        AttributeError, match=r"extra.*PICKLED_ATTRIBUTES = RemoteModule.PICKLED_ATTRIBUTES \+ \('extra',\)"
    ):
        Undeclared("worker1", Affine)


@pytest.mark.parametrize(
    "declared,exc_type,text",
    [
        (["on"], TypeError, "must be a tuple of str"),
        (("label", 3), TypeError, "must be a tuple of str"),
        (("label",), ValueError, "lacks"),
        (RemoteModule.PICKLED_ATTRIBUTES + ("forward",), ValueError, "names ['forward']"),
    ],
)
def test_bad_declarations_fail_when_the_class_is_made(declared, exc_type, text):
    with pytest.raises(exc_type) as info:
        type("Bad", (RemoteModule,), {"PICKLED_ATTRIBUTES": declared})
    assert text in str(info.value) and "RemoteModule.PICKLED_ATTRIBUTES +" in str(info.value)
