"""Contract point 6: forward's arguments are checked on the caller, only the arguments given
travel, and defaults are evaluated on the host by the module's own forward (as locally)."""

import inspect

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

from remote_module import RemoteModule
from remote_module._proxy.calls import RemoteCalls
from tests.proxy import _defaults_remote as d

pytestmark = pytest.mark.usefixtures("rpc_world")


@pytest.fixture
def sent_bytes(monkeypatch):
    """Bytes of every call the proxies make from now on: its pickle plus the storages of the
    tensors that travel beside it."""
    sizes = []
    make_call = RemoteCalls._make_call

    def spy(self, args, kwargs):
        call = make_call(self, args, kwargs)
        side = sum(t.untyped_storage().nbytes() for t in call.payload.side if torch.is_tensor(t))
        sizes.append(len(call.payload.data) + side)
        return call

    monkeypatch.setattr(RemoteCalls, "_make_call", spy)
    return sizes


def test_a_sentinel_default_is_the_hosts_own_object():
    proxy = RemoteModule("worker1", d.SentinelDefault)
    assert d.SentinelDefault()(1) is True  # the local reference
    assert proxy(1) is True
    assert proxy.forward_async(1).wait() is True
    assert proxy(1, mask=None) is False and proxy.forward_async(1, None).wait() is False
    assert inspect.signature(proxy.forward).parameters["mask"].default is d.MISSING


def test_a_mutable_default_is_the_hosts_own_and_keeps_its_mutations():
    proxy = RemoteModule("worker2", d.MutableDefault)
    first, own = proxy(1)
    assert own is True
    assert proxy.forward_async(2).wait() == (first + 1, True)  # the host's list grew
    assert proxy(3, []) == (1, False)  # a list given travels, and is not the default
    assert proxy(4) == (first + 2, True)


def test_a_lambda_default_is_never_sent():
    # the lambda's own default is a lock: it cannot be pickled even by value
    proxy = RemoteModule("worker1", d.LambdaDefault)
    x = torch.arange(3.0)
    expected, _ = d.LambdaDefault()(x)
    for out, own in (proxy(x), proxy.forward_async(x).wait()):
        assert torch.equal(out, expected) and own is True
    out, own = proxy(x, lambda v: v + 1)  # a lambda given travels (by value)
    assert torch.equal(out, x + 1) and own is False


def test_a_16mb_default_tensor_is_not_sent(sent_bytes):
    proxy = RemoteModule("worker1", d.BigDefault)
    x = torch.ones(2, 2)
    for out, own in (proxy(x), proxy.forward_async(x).wait()):
        assert torch.equal(out, x) and own is True
    with dist_autograd.context():  # the non-inline path: tensors go through RPC's tensor channel
        out, own = proxy(x)
        assert torch.equal(out, x) and own is True
    assert len(sent_bytes) == 3
    assert max(sent_bytes) < 4096, sent_bytes


def test_wrong_calls_fail_on_the_caller_and_send_nothing(sent_bytes):
    proxy = RemoteModule("worker1", d.BigDefault)
    for call in (
        lambda: proxy(),  # x missing
        lambda: proxy(torch.ones(1), d.BIG, 3),  # one positional too many
        lambda: proxy.forward_async(torch.ones(1), nope=1),  # unknown keyword
        lambda: proxy.forward_async(torch.ones(1), d.BIG, table=d.BIG),  # table twice
    ):
        with pytest.raises(TypeError) as info:
            call()
        assert "raised on" not in str(info.value)  # Python's own binding error, not the host's
    assert sent_bytes == []
    assert rpc.rpc_sync("worker1", d.module_calls, (proxy.get_module_rref(),)) == 0
    # the same on a worker that received a proxy whose default cannot be pickled (it checks
    # calls against the signature it rebuilt from forward_signature)
    lam = RemoteModule("worker1", d.LambdaDefault)
    messages = rpc.rpc_sync("worker2", d.wrong_call_on_receiver, (lam,))
    assert all(m and "raised on" not in m for m in messages), messages
    assert rpc.rpc_sync("worker1", d.module_calls, (lam.get_module_rref(),)) == 0


# (args, kwargs) of Kinds.forward(a, b=_B, /, c=_C, d=_D, *rest, e, f=_F, **extra)
KIND_CALLS = [
    ((1,), {"e": 5}),
    ((1, 2), {"e": 5}),
    ((1,), {"c": 3, "e": 5}),
    ((1,), {"d": 4, "e": 5}),  # c left out before d: d travels as a keyword
    ((1, 2), {"d": 4, "e": 5, "f": 6}),
    ((1, 2, 3, 4, 10, 11), {"e": 5, "f": 6, "z": 7}),
    ((1, 2), {"c": 3, "e": 5, "a": 99, "b": 98}),  # a, b positional-only: these go to **extra
]


@pytest.mark.parametrize("args,kwargs", KIND_CALLS, ids=[str(i) for i in range(len(KIND_CALLS))])
def test_every_kind_of_parameter_matches_a_local_call(kinds_proxy, args, kwargs):
    expected = d.Kinds()(*args, **kwargs)
    assert kinds_proxy(*args, **kwargs) == expected
    assert kinds_proxy.forward_async(*args, **kwargs).wait() == expected
    # a proxy sent over RPC to another worker renders its methods again, from forward_signature
    assert rpc.rpc_sync("worker2", d.call_received, (kinds_proxy, args, kwargs)) == (expected, expected)


@pytest.fixture(scope="module")
def kinds_proxy(rpc_world):
    return RemoteModule("worker1", d.Kinds)


def test_signatures_show_the_real_defaults(kinds_proxy):
    expected = inspect.signature(d.Kinds().forward)
    assert inspect.signature(kinds_proxy.forward) == expected
    shown = inspect.signature(kinds_proxy.forward_async)
    assert list(shown.parameters.values()) == list(expected.parameters.values())
    assert shown.parameters["c"].default is d._C  # the very objects, on the proxy's maker
    received = rpc.rpc_sync("worker2", d.received_signature, (kinds_proxy,))[:2]
    assert received[0] == str(expected)
    assert received[1].startswith(str(expected).split(" ->")[0])


def test_a_received_proxy_with_unpicklable_or_big_defaults():
    lam = RemoteModule("worker1", d.LambdaDefault)
    big = RemoteModule("worker1", d.BigDefault)
    x = torch.arange(3.0)
    out = rpc.rpc_sync("worker2", d.call_received, (lam, (x,), {}))
    assert [torch.equal(o, x * 2) and own for o, own in out] == [True, True]
    out = rpc.rpc_sync("worker2", d.call_received, (big, (x,), {}))
    assert [torch.equal(o, x) and own for o, own in out] == [True, True]
    # the receiver shows the real parameters and the defaults' reprs
    _, _, params = rpc.rpc_sync("worker2", d.received_signature, (lam,))
    assert [name for name, _ in params] == ["x", "fn"] and params[0][1] is None
    assert params[1][1].startswith("<function LambdaDefault.<lambda> at 0x"), params
    _, _, params = rpc.rpc_sync("worker2", d.received_signature, (big,))
    assert params == [("x", None), ("table", repr(d.BIG))]
