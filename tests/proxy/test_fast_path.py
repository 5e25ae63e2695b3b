"""The small-call fast path (module keys, inlined small tensors) is transparent, and is not
used where it must not be: under distributed autograd, with device maps, for big or
non-CPU tensors."""

import gc
import threading
import time

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.optim import DistributedOptimizer

from remote_module import RemoteModule
from remote_module._proxy import channel as _channel
from remote_module._proxy.wire import INLINE_MAX_BYTES, dumps, loads
from tests._deadlines import HANG_S
from tests._marks import GRAD_ON_WITHOUT_CONTEXT
from tests.proxy import _remote
from tests.proxy._remote import Affine, Raiser, Sleeper

pytestmark = GRAD_ON_WITHOUT_CONTEXT


def roundtrip(obj):
    return loads(dumps(obj, inline=True))


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3, 4),
        torch.randn(3, 4, requires_grad=True),
        torch.tensor(7),
        torch.empty(0, 5),
        torch.arange(20)[::3],
        torch.randn(4, 4).t(),
        torch.ones(3, dtype=torch.bfloat16),
        torch.tensor([True, False]),
        torch.randint(0, 255, (5,), dtype=torch.uint8),
    ],
    ids=lambda t: f"{t.dtype}-{tuple(t.shape)}",
)
def test_inlined_tensor_round_trip(tensor):
    payload = dumps(tensor, inline=True)
    assert payload.side == []  # inline: nothing for the tensor channel
    back = loads(payload)
    assert type(back) is torch.Tensor
    assert back.dtype == tensor.dtype and back.shape == tensor.shape and back.stride() == tensor.stride()
    assert torch.equal(back, tensor.detach())
    assert back.requires_grad == tensor.requires_grad


def test_only_small_dense_cpu_plain_tensors_are_inlined():
    big = torch.zeros(INLINE_MAX_BYTES // 4 + 1)
    meta = torch.empty(3, device="meta")
    param = nn.Parameter(torch.ones(2))
    sparse = torch.eye(3).to_sparse()
    conj = torch.tensor([1 + 2j]).conj()
    payload = dumps([torch.ones(2), big, meta, param, sparse, conj], inline=True)
    assert [t is u for t, u in zip(payload.side, [big, meta, param, sparse, conj])] == [True] * 5
    assert dumps([torch.ones(2)], inline=False).side[0].shape == (2,)  # not inlining: all go aside


def test_aliasing_and_structure_survive():
    t = torch.ones(2)
    back = roundtrip({"a": (t, [t]), "b": _remote.Pair(t, 3)})
    assert back["a"][0] is back["a"][1][0] is back["b"].first
    assert type(back["b"]) is _remote.Pair and back["b"].second == 3


def _pickled(obj):
    """``obj`` through the general path (the pickler), never a short form."""
    import io

    from remote_module._proxy.wire import Payload, _Pickler

    buf = io.BytesIO()
    pickler = _Pickler(buf, True)
    pickler.dump(obj)
    return Payload(buf.getvalue(), pickler.side)


def _short_form_cases():
    base = torch.arange(12.0).reshape(3, 4)
    big = torch.arange(4096.0)  # a 16 KB storage: a small view of it travels as a compact copy
    same = torch.ones(2)
    return {
        "lone tensor": torch.randn(3, 4),
        "lone view": base[1:, ::2],
        "lone channels_last": torch.randn(1, 3, 4, 4).to(memory_format=torch.channels_last),
        "lone requires_grad": torch.randn(2, requires_grad=True),
        "lone small view of a big storage": big[:10],
        "args": ((torch.randn(2), torch.randn(3)), {}),
        "args: one tensor twice": ((same, same), {}),
        "args: a tensor and its view": ((base, base[0]), {}),
        "args: views sharing a big storage": ((big[:2048], big[2048:]), {}),
        "args: empty tensors": ((torch.empty(0), torch.empty(0, 3)), {}),
    }


@pytest.mark.parametrize("name", list(_short_form_cases()))
def test_short_forms_arrive_exactly_as_the_pickled_form(name):
    # The commonest small calls skip the pickler (remote_module._proxy.wire): what arrives must be
    # what the general path delivers: types, values, strides, offsets, identity, storage sharing.
    value = _short_form_cases()[name]
    short = dumps(value, inline=True)
    assert not isinstance(short.data, bytes) or short.data[:1] != b"\x80"  # it took a short form
    a, b = loads(short), loads(_pickled(value))

    def flat(v):
        return [v] if isinstance(v, torch.Tensor) else list(v[0])

    assert type(a) is type(b) and (isinstance(a, torch.Tensor) or (type(a[0]) is tuple and a[1] == {} == b[1]))
    ta, tb = flat(a), flat(b)
    for x, y in zip(ta, tb):
        assert torch.equal(x, y) and x.dtype == y.dtype and x.stride() == y.stride()
        assert x.storage_offset() == y.storage_offset() and x.requires_grad == y.requires_grad
        assert x.untyped_storage().nbytes() == y.untyped_storage().nbytes()
    ptrs = lambda ts: [t.untyped_storage().data_ptr() for t in ts]  # noqa: E731
    same_a = [[p == q for q in ptrs(ta)] for p in ptrs(ta)]
    same_b = [[p == q for q in ptrs(tb)] for p in ptrs(tb)]
    assert same_a == same_b  # storage sharing among the call's tensors is the same
    assert [[x is y for y in ta] for x in ta] == [[x is y for y in tb] for x in tb]


def test_what_takes_no_short_form_still_pickles():
    for value in [((torch.ones(2), 3), {}), ((torch.ones(2),), {"k": 1}), [torch.ones(2)], (torch.ones(2),),
                  ((nn.Parameter(torch.ones(2)),), {}), ((), {})]:
        payload = dumps(value, inline=True)
        assert isinstance(payload.data, bytes) and payload.data[:1] == b"\x80"
        back = loads(payload)
        assert type(back) is type(value)


@pytest.mark.usefixtures("rpc_world")
class TestOverRPC:
    def test_fast_path_only_without_context_and_device_map(self):
        proxy = RemoteModule("worker1", Affine)
        x = torch.ones(4)
        assert proxy._make_call((x,), {}).inline is True
        with dist_autograd.context():
            call = proxy._make_call((x,), {})
            assert call.inline is False and call.payload.side == [x]
        proxy.is_device_map_set = True  # as on a CUDA proxy with a device map
        assert proxy._make_call((x,), {}).inline is False

    def test_same_results_on_both_paths(self):
        proxy = RemoteModule("worker1", Affine, (4,), {"seed": 9})
        twin = Affine(4, seed=9)
        x = torch.randn(3, 4)
        fast = proxy(x, 2.0, shift=torch.ones(4))
        with dist_autograd.context():
            slow = proxy(x, 2.0, shift=torch.ones(4))
        expected = twin(x, 2.0, shift=torch.ones(4))
        assert torch.allclose(fast, expected) and torch.allclose(slow, expected)
        # requires_grad as through torch's tensor channel, and as local calls under no_grad
        assert fast.requires_grad is True
        with torch.no_grad():
            assert proxy(x).requires_grad is False

    def test_same_exceptions_on_both_paths(self):
        proxy = RemoteModule("worker1", Raiser)
        with pytest.raises(_remote.UserError, match="the user's own error"):
            proxy("user")
        with dist_autograd.context():
            with pytest.raises(_remote.UserError, match="the user's own error"):
                proxy("user")

    def test_integer_inputs_still_train_the_remote_table(self):
        # Under distributed autograd the fast path is off, so gradients reach the remote
        # parameters even though the inputs (ids) do not require grad.
        torch.manual_seed(4)
        proxy = RemoteModule("worker2", nn.EmbeddingBag, (10, 3), {"mode": "sum"})
        twin = proxy.get_module_rref().to_here()
        ids, offsets = torch.tensor([1, 2, 2, 7]), torch.tensor([0, 2])
        opt = DistributedOptimizer(torch.optim.SGD, proxy.remote_parameters(), lr=0.5)
        with dist_autograd.context() as ctx:
            dist_autograd.backward(ctx, [proxy(ids, offsets).pow(2).sum()])
            opt.step(ctx)
        twin(ids, offsets).pow(2).sum().backward()
        with torch.no_grad():
            twin.weight -= 0.5 * twin.weight.grad
        assert torch.allclose(proxy.state_dict()["weight"], twin.weight, atol=1e-6)

    def test_big_and_small_arguments_together(self):
        proxy = RemoteModule("worker1", _remote.Nested)
        big = torch.randn(300_000)  # 1.2 MB: tensor channel
        out = proxy({"x": big, "ys": [torch.ones(2)]})
        assert torch.equal(out.first, big + 1) and torch.equal(out.second[1]["y"], torch.ones(2))

    def test_eight_threads_calling_one_proxy(self):
        proxy = RemoteModule("worker2", Affine, (4,), {"seed": 11})
        twin = Affine(4, seed=11)
        calls, errors = 150, []

        def worker(tid):
            gen = torch.Generator().manual_seed(tid)
            for i in range(calls):
                x = torch.randn(2, 4, generator=gen)
                fut = proxy.forward_async(x, float(i % 3)) if i % 2 else None
                out = fut.wait() if fut is not None else proxy(x, float(i % 3))
                if not torch.allclose(out, twin(x, float(i % 3)), atol=1e-5):
                    errors.append((tid, i))

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=HANG_S)
        assert not any(t.is_alive() for t in threads), f"hang guard: still calling after {HANG_S} s"
        assert errors == []

    def test_no_leak_over_many_calls(self):
        proxy = RemoteModule("worker1", Affine)
        x = torch.ones(1, 4)
        with torch.no_grad():
            for _ in range(300):
                proxy(x)
            gc.collect()
            caller0, host0 = _remote.rss_mb(), rpc.rpc_sync("worker1", _remote.rss_mb)
            for _ in range(3000):
                proxy(x)
                proxy.forward_async(x).wait()
            gc.collect()
            caller1, host1 = _remote.rss_mb(), rpc.rpc_sync("worker1", _remote.rss_mb)
        assert caller1 - caller0 < 20 and host1 - host0 < 20, (caller0, caller1, host0, host1)

    def test_host_registry_forgets_dead_modules(self):
        proxies = [RemoteModule("worker2", Affine) for _ in range(3)]
        keys = {p.module_key for p in proxies}
        assert len(keys) == 3 and keys <= rpc.rpc_sync("worker2", _remote.registered_keys)
        del proxies
        # The owner hears of the deleted RRefs in its own time (at load ~10 it took over 60 s).
        # A proxy is a reference cycle (its generated methods are bound to it), freed by the
        # collector, and one can outlive a collection (seen beside busy loops: the next
        # automatic one then comes only after enough allocations, later the slower the
        # machine): collected again on every poll.
        deadline = time.monotonic() + HANG_S
        while True:
            gc.collect()
            if not keys & rpc.rpc_sync("worker2", _remote.registered_keys):
                break
            assert time.monotonic() < deadline, f"hang guard ({HANG_S} s): the host still holds modules of {keys}"
            time.sleep(0.1)


def warm(proxy, *args):
    """One answered call: the channel then knows what a call costs on the host."""
    proxy.forward_async(*args).wait()
    channel = proxy._channel
    assert channel.cost is not None
    with channel.lock:  # a host thread preempted under load can report a cheap call as heavy
        # (> HEAVY_CALL_S: a message each, rightly); these tests are about cheap calls
        channel.cost = min(channel.cost, 0.0)
    return channel


@pytest.mark.usefixtures("rpc_world")
class TestChannel:
    def test_a_burst_of_async_calls_each_gets_its_own_result(self):
        proxy = RemoteModule("worker1", Affine, (4,), {"seed": 12})
        twin = Affine(4, seed=12)
        xs = [torch.randn(2, 4) for _ in range(64)]
        futs = [proxy.forward_async(x, float(i)) for i, x in enumerate(xs)]
        for i, (x, fut) in enumerate(zip(xs, futs)):
            assert isinstance(fut, torch.futures.Future)
            assert torch.allclose(fut.wait(), twin(x, float(i)), atol=1e-5)
        channel = proxy._channel
        assert channel.outstanding() == 0 and channel._in_flight == 0 and not channel._queue

    def test_one_failing_call_in_a_burst_fails_alone(self):
        proxy = RemoteModule("worker1", Raiser)
        kinds = ["ok", "user", "ok", "builtin", "ok"] * 6
        futs = [proxy.forward_async(k) for k in kinds]
        for kind, fut in zip(kinds, futs):
            if kind == "ok":
                assert fut.wait() is None
            elif kind == "user":
                with pytest.raises(_remote.UserError, match="the user's own error"):
                    fut.wait()
            else:
                with pytest.raises(ValueError, match="bad value inside forward"):
                    fut.wait()

    def test_arguments_are_captured_when_the_call_is_made(self):
        proxy = RemoteModule("worker1", nn.Identity)
        x = torch.zeros(3)
        futs = []
        for i in range(20):
            x.fill_(i)
            futs.append(proxy.forward_async(x))
        assert [f.wait()[0].item() for f in futs] == list(range(20))

    def test_unpicklable_argument_fails_alone_and_at_once(self):
        proxy = RemoteModule("worker1", Affine)
        good = [proxy.forward_async(torch.ones(4)) for _ in range(10)]
        with pytest.raises(TypeError, match="argument 'x'"):
            proxy.forward_async(threading.Lock())
        assert all(f.wait().shape == (4,) for f in good)

    def test_not_used_under_dist_autograd_nor_for_big_tensors(self):
        proxy = RemoteModule("worker1", nn.Identity)
        with dist_autograd.context():
            assert torch.equal(proxy.forward_async(torch.ones(2)).wait(), torch.ones(2))
        channel = warm(proxy, torch.ones(2))
        big = torch.ones(INLINE_MAX_BYTES // 4 + 1)
        with dist_autograd.context():
            futs = [proxy.forward_async(torch.ones(2)) for _ in range(16)]
            assert all(torch.equal(f.wait(), torch.ones(2)) for f in futs)
        futs = [proxy.forward_async(big) for _ in range(16)]
        assert all(torch.equal(f.wait(), big) for f in futs)
        assert channel.shared_messages == 0  # one message each

    def test_a_burst_shares_messages(self):
        proxy = RemoteModule("worker2", nn.Identity)
        channel = warm(proxy, torch.ones(1))
        sent, messages = channel.calls_sent, channel.messages_sent
        torch.futures.wait_all([proxy.forward_async(torch.ones(1)) for _ in range(64)])
        assert channel.calls_sent - sent == 64 and channel.messages_sent - messages < 64
        assert channel.shared_messages > 0

    def test_slow_calls_are_not_coalesced(self):
        proxy = RemoteModule("worker2", Sleeper)
        torch.futures.wait_all([proxy.forward_async(0.005) for _ in range(8)])
        channel = proxy._channel
        assert channel.cost > _channel.HEAVY_CALL_S
        futs = [proxy.forward_async(0.002) for _ in range(10)]
        assert [f.wait() for f in futs] == [0.002] * 10
        assert channel.shared_messages == 0  # these went one message each


@pytest.mark.usefixtures("rpc_world")
def test_forward_async_records_distributed_autograd():
    proxy = RemoteModule("worker1", Affine, (4,), {"seed": 21})
    twin = Affine(4, seed=21)
    x = torch.randn(3, 4)
    opt = DistributedOptimizer(torch.optim.SGD, proxy.remote_parameters(), lr=0.1)
    with dist_autograd.context() as ctx:
        out = proxy.forward_async(x).wait()
        dist_autograd.backward(ctx, [out.sum()])
        opt.step(ctx)
    twin(x).sum().backward()
    with torch.no_grad():
        twin.weight -= 0.1 * twin.weight.grad
    assert torch.allclose(proxy.state_dict()["weight"], twin.weight, atol=1e-6)
