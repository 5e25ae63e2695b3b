"""No silent no-training (issue 20): a remote forward that records gradients outside a
distributed autograd context (grad mode on, trainable parameters on the hosts or inputs that
require grad) warns once per object, for a RemoteModule proxy, a RemotePipeline and a sharded
LocalModule; it stays silent under no_grad / inference_mode, inside a context, and for frozen
hosts given inputs without grad."""

from __future__ import annotations

import contextlib
import threading
import warnings

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.tensor import Partial

from remote_module import RemoteModule
from remote_module.pipeline import split_sequential
from remote_module.sharded import LocalModule
from tests._deadlines import HANG_S
from tests.proxy import _remote

pytestmark = pytest.mark.usefixtures("rpc_world")

W1, W2 = "worker1/cpu", "worker2/cpu"
MESH = ["worker1", "worker2"]
MESSAGE = "outside a torch.distributed.autograd context"


@contextlib.contextmanager
def ours():
    """The warnings of ours raised inside (every one, whatever the filters say)."""
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        found: list[warnings.WarningMessage] = []
        yield found
    found.extend(w for w in got if MESSAGE in str(w.message))


def proxy(frozen: bool = False) -> RemoteModule:
    return RemoteModule(W1, _remote.frozen_linear if frozen else nn.Linear, (4, 3))


def pipe(frozen: bool = False):
    layers = [nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)]
    if frozen:
        for layer in layers:
            layer.requires_grad_(False)
    return split_sequential(nn.Sequential(*layers), [W1, W2], chunks=2)


def local_module(frozen: bool = False) -> LocalModule:
    cls = _remote.frozen_linear if frozen else nn.Linear
    return LocalModule(MESH, cls, (4, 3), out_placements=[Partial("sum")])


KINDS = {
    "proxy": (proxy, "RemoteModule on worker 'worker1' (torch.nn.modules.linear.Linear)", "proxy.remote_parameters()",
              "proxy"),
    "pipeline": (pipe, "RemotePipeline (stages on 'worker1', 'worker2')", "pipe.remote_parameters()", "pipeline"),
    "local_module": (local_module, "LocalModule on mesh ['worker1', 'worker2']", "local_module.remote_parameters()",
                     "LocalModule"),
}


@pytest.mark.parametrize("kind", KINDS)
def test_a_forward_recording_gradients_outside_a_context_warns_once_per_object(kind):
    make, what, handle, once = KINDS[kind]
    first, second = make(), make()
    x = torch.randn(6, 4)
    with ours() as got:
        first(x)  # the nanoGPT trap: loss.backward() would follow and train nothing remote
    assert len(got) == 1, [str(w.message) for w in got]
    warning = got[0]
    assert warning.category is UserWarning
    assert warning.filename == __file__  # points at the user's call
    text = str(warning.message)
    assert text.startswith(what), text
    for needed in ("loss.backward() reaches neither its parameters on the hosts", "dist_autograd.backward(ctx, [loss])",
                   f"DistributedOptimizer(optimizer_class, {handle}, ...)", "torch.no_grad()", f"once per {once}"):
        assert needed in text, (needed, text)
    with ours() as got:
        first(x)
        first(x)
    assert got == []  # once per object, not per call
    with ours() as got:
        second(x)
    assert len(got) == 1  # another object warns on its own


def test_forward_async_warns_like_forward():
    p = proxy()
    with ours() as got:
        p.forward_async(torch.randn(2, 4)).wait()
        p(torch.randn(2, 4))
    assert len(got) == 1 and got[0].filename == __file__


@pytest.mark.parametrize("kind", KINDS)
def test_silent_without_grad_inside_a_context_and_for_frozen_hosts(kind):
    make, *_ = KINDS[kind]
    module, frozen = make(), make(frozen=True)
    x = torch.randn(6, 4)
    with ours() as got:
        with torch.no_grad():
            module(x)
        with torch.inference_mode():
            module(x)
        with dist_autograd.context() as ctx:
            out = module(x)
            loss = (out if isinstance(out, torch.Tensor) else out.full_tensor()).sum()
            dist_autograd.backward(ctx, [loss])
        frozen(x)  # grad mode on, but nothing on the hosts can train and x needs no grad
    assert got == [], [str(w.message) for w in got]
    with ours() as got:  # still armed: silence above was not "already warned"
        module(x)
    assert len(got) == 1


def test_inputs_that_require_grad_warn_even_for_a_parameter_free_host():
    relu = RemoteModule(W1, nn.ReLU)
    with ours() as got:
        relu(torch.randn(3, 4))  # nothing to train, nothing to cut
    assert got == []
    with ours() as got:
        relu(torch.randn(3, 4, requires_grad=True))  # the gradient to x would be cut here
    assert len(got) == 1


def test_remote_trainable_is_known_without_a_call_and_travels_with_the_proxy():
    assert proxy().remote_trainable is True
    assert proxy(frozen=True).remote_trainable is False
    assert RemoteModule(W1, nn.ReLU).remote_trainable is False


@pytest.mark.parametrize("kind", KINDS)
def test_a_copy_sent_over_rpc_warns_on_its_own(kind):
    # the copy is another object in another process: the sender having warned does not mute it
    make, *_ = KINDS[kind]
    thing, x = make(), torch.randn(6, 4)
    with ours() as got:
        thing(x)
    assert len(got) == 1
    assert rpc.rpc_sync("worker2", _remote.untrained_warnings, (thing, x)) == 1


def test_a_call_refused_before_anything_runs_does_not_use_up_the_warning():
    p = proxy()
    lm = LocalModule(MESH, nn.Linear, (4, 3), in_placements=[None], out_placements=[Partial("sum")])
    with ours() as got:
        with pytest.raises(TypeError, match="cannot be sent over RPC"):
            p(threading.Lock())  # refused here: nothing sent, nothing recorded
        with pytest.raises(ValueError, match=r"expects 1 input"):
            lm(torch.randn(2, 4), torch.randn(2, 4))
    assert got == [], [str(w.message) for w in got]
    with ours() as got:
        p(torch.randn(2, 4))
        lm(torch.randn(2, 4))
    assert len(got) == 2 and all(w.filename == __file__ for w in got)


def test_a_nested_input_that_requires_grad_warns_for_a_frozen_host():
    # an LSTM's (h0, c0): RPC carries nested tensors, so their gradient is cut as a top-level one's
    lstm = RemoteModule(W1, _remote.frozen_lstm, (4, 3))
    x, h, c = torch.randn(2, 1, 4), torch.zeros(1, 1, 3), torch.zeros(1, 1, 3)
    with ours() as got:
        lstm(x, (h, c))
    assert got == []
    with ours() as got:
        lstm(x, (h.requires_grad_(), c))
    assert len(got) == 1 and got[0].filename == __file__


def test_a_burst_from_several_threads_warns_once(monkeypatch):
    # every thread passes the "not warned yet" check before any of them warns (the barrier
    # holds them there): still one warning per object
    from remote_module._core import untrained as _untrained

    threads = 4
    barrier = threading.Barrier(threads, timeout=HANG_S)  # a hang guard
    real = _untrained.in_dist_autograd_context

    def slow_check():
        barrier.wait()
        return real()

    monkeypatch.setattr(_untrained, "in_dist_autograd_context", slow_check)
    p = proxy()
    x = torch.randn(2, 4)
    with ours() as got:
        workers = [threading.Thread(target=p, args=(x,)) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    assert len(got) == 1, [str(w.message) for w in got]


def test_inputs_that_hold_themselves_are_looked_into_once():
    from remote_module._core.untrained import _holds_grad_input

    loop: list = [torch.zeros(1)]
    loop.append(loop)
    assert _holds_grad_input(loop) is False
    loop.append({"h": (torch.zeros(1, requires_grad=True),)})
    assert _holds_grad_input(loop) is True
