"""What travels when a proxy is sent over RPC, and that nothing else does."""

import io
import pickle
import warnings

import pytest
import torch
import torch.distributed.rpc as rpc

import remote_module
from remote_module import RemoteModule
from remote_module._proxy.pickling import IGNORED_ATTRIBUTES, NOT_PICKLABLE, NOT_UNPICKLABLE, check_attributes
from tests._marks import GRAD_ON_WITHOUT_CONTEXT
from tests.proxy import _remote, _subclass_remote
from tests.proxy._remote import Affine

pytestmark = [pytest.mark.usefixtures("rpc_world"), GRAD_ON_WITHOUT_CONTEXT]


def test_pickled_attributes_is_public_and_complete():
    assert {"on", "device", "is_device_map_set", "is_scriptable", "module_rref"} <= set(
        remote_module.PICKLED_ATTRIBUTES
    )
    proxy = RemoteModule("worker1", Affine)
    # every instance attribute is either sent or deliberately ignored
    for name in vars(proxy):
        assert name in remote_module.PICKLED_ATTRIBUTES or name in IGNORED_ATTRIBUTES


def test_proxy_sent_to_a_third_worker_calls_the_host():
    proxy = RemoteModule("worker1/cpu", Affine, (4,), {"seed": 2})
    x = torch.randn(3, 4)
    expected = Affine(4, seed=2)(x)
    sync_out, async_out, cls_name = rpc.rpc_sync("worker2", _remote.use_proxy, (proxy, x))
    assert cls_name == "RemoteModule"
    assert torch.allclose(sync_out, expected) and torch.allclose(async_out, expected)


def test_proxy_round_trip_keeps_signature_and_attributes():
    proxy = RemoteModule("worker1/cpu", Affine)
    back = rpc.rpc_sync("worker2", _remote.echo, (proxy,))
    assert type(back) is RemoteModule and back is not proxy
    for name in remote_module.PICKLED_ATTRIBUTES:
        if name != "module_rref":
            assert getattr(back, name) == getattr(proxy, name), name
    assert back.get_module_rref().owner_name() == "worker1"
    import inspect

    assert str(inspect.signature(back.forward)) == str(inspect.signature(proxy.forward))
    x = torch.randn(2, 4)
    assert torch.equal(back(x), proxy(x))


def test_attribute_added_later_is_not_sent_and_warns():
    proxy = RemoteModule("worker1/cpu", Affine)
    proxy.note = "local only"
    with pytest.warns(RuntimeWarning, match="'note'"):
        arrived = rpc.rpc_sync("worker2", _remote.has_attribute, (proxy, "note"))
    assert arrived is False


def test_constructor_rejects_unlisted_attributes():
    class WithExtra(RemoteModule):
        def __init__(self, *args, **kwargs):
            self.extra_state = 1  # set before RemoteModule.__init__ checks
            super().__init__(*args, **kwargs)

    with pytest.raises(AttributeError, match="extra_state"):
        WithExtra("worker1", Affine)
    proxy = RemoteModule("worker1", Affine)
    proxy.later = 2
    with pytest.raises(AttributeError, match="later"):
        check_attributes(proxy)


def test_subclass_travels_as_itself():
    back = rpc.rpc_sync("worker2", _remote.echo, (_subclass_remote.TaggedRemoteModule("worker1", Affine),))
    assert type(back) is _subclass_remote.TaggedRemoteModule


def test_plain_pickle_and_torch_save_refuse():
    proxy = RemoteModule("worker1", Affine)
    with pytest.raises(RuntimeError, match="RemoteModule can only be pickled when using RPC") as info:
        pickle.dumps(proxy)
    assert str(info.value) == NOT_PICKLABLE  # torch's text (the method holds it as a literal)
    with pytest.raises(RuntimeError, match="RemoteModule can only be pickled when using RPC"):
        torch.save(proxy, io.BytesIO())
    with pytest.raises(RuntimeError, match="only be unpickled when using RPC") as info:
        proxy.__setstate__({})
    assert str(info.value) == NOT_UNPICKLABLE


def test_ordinary_script_modules_still_travel():
    scripted = torch.jit.script(torch.nn.Linear(2, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = rpc.rpc_sync("worker2", _remote.echo, (scripted,))
    x = torch.randn(1, 2)
    assert torch.equal(back(x), scripted(x))


def test_per_process_caches_do_not_travel():
    proxy = RemoteModule("worker1/cpu", Affine)
    x = torch.randn(2, 4)
    proxy(x)
    proxy.forward_async(x).wait()  # creates the host-info cache and the call channel
    assert proxy._host_info is not None and proxy._channel is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an unlisted attribute would warn
        sync_out, async_out, _ = rpc.rpc_sync("worker2", _remote.use_proxy, (proxy, x))
    assert torch.equal(sync_out, proxy(x)) and torch.equal(async_out, proxy(x))
