"""Creating proxies costs one message each: ``RemoteModule(...)`` and
``RemoteModule.create_async(...)`` (N proxies at once: N messages, all in flight together)."""

import threading
import time

import pytest
import torch
import torch.distributed.rpc as rpc

import remote_module.remote_module as rm_impl
from remote_module import RemoteModule
from remote_module._core.errors import CallTimeout, RemoteModuleError
from tests._deadlines import HANG_S
from tests._faults import gates
from tests._marks import GRAD_ON_WITHOUT_CONTEXT
from tests.proxy import _held, _remote, _subclass_remote
from tests.proxy._remote import Affine
from tests.proxy._torchscript_remote import MyModule, MyModuleInterface

pytestmark = [pytest.mark.usefixtures("rpc_world"), GRAD_ON_WITHOUT_CONTEXT]


class MessageCounter:
    """Counts the RPCs this process starts (rpc_async, rpc_sync, remote) and the most
    rpc_async calls in flight at once."""

    def __init__(self, monkeypatch):
        self.counts = {"rpc_async": 0, "rpc_sync": 0, "remote": 0}
        self.in_flight = self.max_in_flight = 0
        self._lock = threading.Lock()
        for name in self.counts:
            monkeypatch.setattr(rpc, name, self._wrap(name, getattr(rpc, name)))

    def _wrap(self, name, real):
        def counted(*args, **kwargs):
            with self._lock:
                self.counts[name] += 1
            result = real(*args, **kwargs)
            if name == "rpc_async":
                with self._lock:
                    self.in_flight += 1
                    self.max_in_flight = max(self.max_in_flight, self.in_flight)
                result.add_done_callback(self._answered)
            return result

        return counted

    def _answered(self, _):
        with self._lock:
            self.in_flight -= 1


def test_the_constructor_sends_one_message(monkeypatch):
    counter = MessageCounter(monkeypatch)
    proxy = RemoteModule("worker1/cpu", Affine, (4,), {"seed": 4})
    assert counter.counts == {"rpc_async": 1, "rpc_sync": 0, "remote": 0}
    monkeypatch.undo()
    x = torch.randn(2, 4)
    assert torch.allclose(proxy(x), Affine(4, seed=4)(x))


def test_n_proxies_cost_n_messages_all_in_flight_together(monkeypatch):
    n = 4
    counter = MessageCounter(monkeypatch)
    # each constructor holds on a gate of its own until all four are being built: one after
    # another would never get there (the test fails at the hang guard, whatever the speed)
    hosts, keys = [f"worker{1 + i % 2}" for i in range(n)], [f"create-together-{i}" for i in range(n)]
    futures = [RemoteModule.create_async(f"{hosts[i]}/cpu", _held.TogetherInit, (i, keys[i]), timeout=HANG_S)
               for i in range(n)]
    sent = dict(counter.counts)  # before the polls below (rpc_sync)
    try:
        _held.wait_until(lambda: all(rpc.rpc_sync(h, gates.holding, (k,)) for h, k in zip(hosts, keys)),
                         "the four constructors running at the same time")
    finally:
        for h, k in zip(hosts, keys):
            rpc.rpc_sync(h, gates.release, (k,))
    proxies = [f.wait() for f in futures]
    assert sent == {"rpc_async": n, "rpc_sync": 0, "remote": 0}
    assert counter.max_in_flight == n
    monkeypatch.undo()
    assert all(type(p) is RemoteModule for p in proxies)
    assert [p.on for p in proxies] == ["worker1", "worker2", "worker1", "worker2"]
    x = torch.ones(2)
    outputs = [p(x) for p in proxies]
    assert [tag for tag, _, _, _ in outputs] == list(range(n))
    assert all(torch.equal(out, x * i) for i, (_, _, _, out) in enumerate(outputs))
    starts = [start for _, start, _, _ in outputs]
    ends = [end for _, _, end, _ in outputs]
    assert max(starts) < min(ends), (starts, ends)  # the hosts built all four at the same time


def test_constructor_errors_fail_the_future_with_their_type():
    fut = RemoteModule.create_async("worker1", _remote.FailsInInit)
    with pytest.raises(ZeroDivisionError, match="constructor failed on purpose") as info:
        fut.wait()
    assert "worker1" in str(info.value) and "FailsInInit" in str(info.value)
    with pytest.raises(ValueError, match=r"^Expect `module_cls\(\*args, \*\*kwargs\)` returns an instance"):
        RemoteModule.create_async("worker2", _remote.not_a_module_factory, (2,)).wait()


def test_system_exit_in_a_constructor_fails_at_once():
    # at once: with the host's SystemExit, not at the timeout (a CallTimeout, which this is not)
    start = time.monotonic()
    with pytest.raises(RemoteModuleError) as info:
        RemoteModule("worker2", gates.ExitsInInit, timeout=HANG_S)
    assert type(info.value).__name__ == "SystemExit" and "worker2" in str(info.value)
    assert not isinstance(info.value, CallTimeout)
    assert time.monotonic() - start < HANG_S, "hang guard"
    assert RemoteModule("worker2", Affine)(torch.zeros(1, 4)).shape == (1, 4)  # the host still serves


def test_bad_arguments_raise_from_create_async_itself(monkeypatch):
    with pytest.raises(ValueError, match="names worker 'nobody'"):
        RemoteModule.create_async("nobody/cpu", Affine)
    with pytest.raises(TypeError, match="args must be a tuple"):
        RemoteModule.create_async("worker1", Affine, 5)
    with pytest.raises(TypeError, match=r"unknown options \['timout'\]"):
        RemoteModule.create_async("worker1", Affine, timout=5)
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        RemoteModule.create_async("worker1", Affine, timeout=0)
    monkeypatch.setattr(rm_impl, "is_rpc_initialized", lambda: False)
    with pytest.raises(RuntimeError, match=r"create_async\(\.\.\.\) needs torch\.distributed\.rpc: call rpc\.init_rpc"):
        RemoteModule.create_async("worker1", Affine)


def test_a_hung_creation_times_out_naming_the_worker():
    for i, make in enumerate(
        (lambda key: RemoteModule("worker1", _held.HeldInit, (key,), timeout=0.5),
         lambda key: RemoteModule.create_async("worker1", _held.HeldInit, (key,), timeout=0.5).wait())
    ):
        key = f"create-timeout-{i}"
        # the host holds the constructor until the error is in (tests/proxy/_held.py)
        error = _held.fails_while_held(make, key, CallTimeout, 0.5)
        assert "worker1" in str(error) and "HeldInit" in str(error)
        # The late answer (the module's RRef) is still received and dropped, so the host frees
        # the module (an RRef left unconfirmed would keep it, and hang graceful shutdown).
        _held.wait_until(lambda: rpc.rpc_sync("worker1", _held.held_instance, (key,)) == "gone",
                         f"the host freed the module built late ({key})")


def test_options_and_subclasses():
    seconds = HANG_S + 0.5  # a timeout of its own, long enough to build the module at any speed
    scriptable = RemoteModule.create_async(
        "worker2", MyModule, (1,), _module_interface_cls=MyModuleInterface, timeout=seconds
    ).wait()
    assert scriptable.is_scriptable and scriptable.timeout == seconds
    word, number, t = scriptable(torch.ones(1), 3)
    assert (word, number) == ("default", 3) and torch.equal(t, torch.full((1,), 2.0))
    tagged = _subclass_remote.TaggedRemoteModule.create_async("worker1", Affine).wait()
    assert type(tagged) is _subclass_remote.TaggedRemoteModule
    x = torch.randn(1, 4)
    assert torch.allclose(tagged(x), Affine()(x))
