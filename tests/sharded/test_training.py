"""A Megatron-style MLP over 2 and 3 workers with LocalModule: column-parallel Linear + ReLU
(output Shard(-1)), then row-parallel Linear without bias (input Shard(-1), output
Partial(sum)), the bias added on the caller after the reduction. Forward, gradients and
parameters after optimizer steps equal a local model; state_dict keys and round trip; the
intermediate activation goes from the column shard to the row shard on each worker and never
to the caller; a training loop does not grow the hosts' shard stores."""

from __future__ import annotations

import gc
import time

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.tensor import Partial, Replicate, Shard

from remote_module.sharded import LocalModule, distribute
from remote_module.sharded._tensor import RELEASE_DELAY_S, _releaser
from tests._deadlines import HANG_S
from tests._marks import GRAD_ON_WITHOUT_CONTEXT
from tests.sharded import _training_remote as remote
from tests.sharded._training_remote import (
    ColumnShard,
    PtrColumnShard,
    RecordingRowShard,
    RowShard,
    TracingColumnShard,
)

pytestmark = [pytest.mark.usefixtures("rpc_world"), GRAD_ON_WITHOUT_CONTEXT]

#: The pytest process (worker0) is a mesh member in the 3-worker mesh.
MESHES = {2: ("worker1", "worker2"), 3: ("worker0", "worker1", "worker2")}
#: Hidden sizes: even over 2 workers, uneven (4, 3, 3) over 3.
HIDDEN = {2: 8, 3: 10}
D_IN, D_OUT, BATCH = 5, 3, 6
WORKERS = ("worker0", "worker1", "worker2")


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


class LocalMLP(nn.Module):
    """The single-process reference: row(relu(col(x))) + bias."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.col = nn.Linear(D_IN, hidden)
        self.row = nn.Linear(hidden, D_OUT, bias=False)
        self.bias = nn.Parameter(torch.randn(D_OUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.row(torch.relu(self.col(x))) + self.bias


def slices(local: LocalMLP, n: int) -> tuple[list, list, list]:
    """Per rank: the column shard's weight rows and bias entries, the row shard's weight columns."""
    w1, b1, w2 = (p.detach().clone() for p in (local.col.weight, local.col.bias, local.row.weight))
    return (
        [t.clone() for t in torch.tensor_split(w1, n, dim=0)],
        [t.clone() for t in torch.tensor_split(b1, n)],
        [t.clone() for t in torch.tensor_split(w2, n, dim=1)],
    )


def sharded(
    local: LocalMLP, mesh, col_cls=ColumnShard, row_cls=RowShard
) -> tuple[LocalModule, LocalModule, nn.Parameter]:
    """The sharded twin of ``local``: column and row LocalModules with its slices, and the bias."""
    w1s, b1s, w2s = slices(local, len(mesh))
    col = LocalModule(mesh, col_cls, lambda r: ((D_IN, w1s[r].shape[0], w1s[r], b1s[r]), None),
                      in_placements=[Replicate()], out_placements=[Shard(-1)])
    row = LocalModule(mesh, row_cls, lambda r: ((w2s[r].shape[1], D_OUT, w2s[r]), None),
                      in_placements=[Shard(-1)], out_placements=Partial("sum"))
    return col, row, nn.Parameter(local.bias.detach().clone())


def run(col: LocalModule, row: LocalModule, bias: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return row(col(x)).full_tensor() + bias


def assert_same_parameters(col: LocalModule, row: LocalModule, bias: torch.Tensor, local: LocalMLP) -> None:
    n = len(col.mesh)
    cs, rs = col.state_dict(), row.state_dict()
    got_w1 = torch.cat([cs[f"shards.{r}.linear.weight"] for r in range(n)], dim=0)
    got_b1 = torch.cat([cs[f"shards.{r}.linear.bias"] for r in range(n)])
    got_w2 = torch.cat([rs[f"shards.{r}.linear.weight"] for r in range(n)], dim=1)
    for name, got, want in (("col.weight", got_w1, local.col.weight), ("col.bias", got_b1, local.col.bias),
                            ("row.weight", got_w2, local.row.weight), ("bias", bias, local.bias)):
        torch.testing.assert_close(got.detach(), want.detach(), atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")


# ---- forward, gradients, training -------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3])
def test_forward_equals_the_local_model(n):
    local = LocalMLP(HIDDEN[n])
    col, row, bias = sharded(local, MESHES[n])
    x = torch.randn(BATCH, D_IN)
    h = col(x)
    assert h.placement == Shard(1) and tuple(h.shape) == (BATCH, HIDDEN[n])
    expected_widths = [t.shape[0] for t in torch.tensor_split(torch.empty(HIDDEN[n]), n)]
    assert [s[1] for s in h.local_shapes] == expected_widths  # (4, 3, 3) for 3 workers
    torch.testing.assert_close(run(col, row, bias, x), local(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("n", [2, 3])
def test_gradients_on_the_hosts_equal_local_autograd(n):
    local = LocalMLP(HIDDEN[n])
    col, row, bias = sharded(local, MESHES[n])
    x, target = torch.randn(BATCH, D_IN), torch.randn(BATCH, D_OUT)
    F.mse_loss(local(x), target).backward()
    with dist_autograd.context() as ctx:
        dist_autograd.backward(ctx, [F.mse_loss(run(col, row, bias, x), target)])
        grads = {}
        for name, lm in (("col", col), ("row", row)):
            grads[name] = [rpc.rpc_sync(p.owner(), remote.gradient_of, (p, ctx)) for p in lm.remote_parameters()]
        bias_grad = dist_autograd.get_gradients(ctx)[bias]
    assert all(g is not None for gs in grads.values() for g in gs), "a shard parameter got no gradient"
    w1 = torch.cat(grads["col"][0::2], dim=0)  # each column shard: weight, bias
    b1 = torch.cat(grads["col"][1::2])
    w2 = torch.cat(grads["row"], dim=1)
    for name, got, want in (("col.weight", w1, local.col.weight.grad), ("col.bias", b1, local.col.bias.grad),
                            ("row.weight", w2, local.row.weight.grad), ("bias", bias_grad, local.bias.grad)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=lambda m: f"gradient of {name}: {m}")


@pytest.mark.parametrize("opt_cls, opt_kwargs", [(torch.optim.SGD, {"lr": 0.1}), (torch.optim.Adam, {"lr": 0.05})],
                         ids=["SGD", "Adam"])
@pytest.mark.parametrize("n", [2, 3])
def test_parameters_after_three_steps_equal_a_local_model(n, opt_cls, opt_kwargs):
    local = LocalMLP(HIDDEN[n])
    col, row, bias = sharded(local, MESHES[n])
    params = col.remote_parameters() + row.remote_parameters() + [rpc.RRef(bias)]
    assert len(params) == 3 * n + 1
    dist_opt = DistributedOptimizer(opt_cls, params, **opt_kwargs)
    local_opt = opt_cls(local.parameters(), **opt_kwargs)
    start = local.col.weight.detach().clone()
    for step in range(3):
        x, target = torch.randn(BATCH, D_IN), torch.randn(BATCH, D_OUT)
        with dist_autograd.context() as ctx:
            y = run(col, row, bias, x)
            dist_autograd.backward(ctx, [F.mse_loss(y, target)])
            dist_opt.step(ctx)
        local_opt.zero_grad()
        want = local(x)
        F.mse_loss(want, target).backward()
        local_opt.step()
        torch.testing.assert_close(y.detach(), want.detach(), atol=1e-5, rtol=0, msg=lambda m: f"step {step}: {m}")
    assert not torch.allclose(local.col.weight, start, atol=1e-3), "training changed nothing: a vacuous comparison"
    assert_same_parameters(col, row, bias, local)


@pytest.mark.parametrize("n", [2, 3])
def test_requires_grad_reaches_every_shard_as_on_the_local_model(n):
    # nn.Module.requires_grad_ walks local parameters only, and the shard proxies hold none:
    # col.requires_grad_(False) was a silent no-op and the shards kept training
    local = LocalMLP(HIDDEN[n])
    col, row, bias = sharded(local, MESHES[n])
    assert col.requires_grad_(False) is col
    assert not any(shard.remote_trainable for shard in col.shards)
    params = col.remote_parameters()
    assert not any(rpc.rpc_sync(p.owner(), remote.rref_requires_grad, (p,)) for p in params)
    local.col.requires_grad_(False)
    opt = DistributedOptimizer(torch.optim.SGD, row.remote_parameters(), lr=0.5)
    x = torch.randn(BATCH, D_IN)
    with dist_autograd.context() as ctx:
        loss = run(col, row, bias, x).square().sum()
        dist_autograd.backward(ctx, [loss])
        opt.step(ctx)
    local_loss = local(x).square().sum()
    local_loss.backward()
    with torch.no_grad():
        local.row.weight -= 0.5 * local.row.weight.grad
    local.bias.grad = None
    bias.data.copy_(local.bias)
    assert_same_parameters(col, row, bias, local)  # the frozen column shards kept their weights
    col.requires_grad_()
    assert all(rpc.rpc_sync(p.owner(), remote.rref_requires_grad, (p,)) for p in params)
    assert all(shard.remote_trainable for shard in col.shards)


# ---- state_dict -----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3])
def test_state_dict_keys_are_shard_rank_then_the_shard_modules_own_keys(n):
    local = LocalMLP(HIDDEN[n])
    w1s, b1s, w2s = slices(local, n)
    mesh = MESHES[n]
    # shards built with zeros (sizes only), then loaded with the local model's slices
    col = LocalModule(mesh, ColumnShard, lambda r: ((D_IN, w1s[r].shape[0]), None),
                      in_placements=[Replicate()], out_placements=[Shard(-1)])
    row = LocalModule(mesh, RowShard, lambda r: ((w2s[r].shape[1], D_OUT), None),
                      in_placements=[Shard(-1)], out_placements=[Partial("sum")])
    own_col = list(ColumnShard(D_IN, 2).state_dict())
    own_row = list(RowShard(2, D_OUT).state_dict())
    assert own_col == ["linear.weight", "linear.bias"] and own_row == ["linear.weight"]
    assert list(col.state_dict()) == [f"shards.{r}.{k}" for r in range(n) for k in own_col]
    assert list(row.state_dict()) == [f"shards.{r}.{k}" for r in range(n) for k in own_row]

    x = torch.randn(BATCH, D_IN)
    assert not torch.allclose(row(col(x)).full_tensor(), local.row(torch.relu(local.col(x))), atol=1e-3)
    col_sd = {f"shards.{r}.linear.{k}": v[r] for r in range(n) for k, v in (("weight", w1s), ("bias", b1s))}
    row_sd = {f"shards.{r}.linear.weight": w2s[r] for r in range(n)}
    assert tuple(col.load_state_dict(col_sd)) == ([], [])
    assert tuple(row.load_state_dict(row_sd)) == ([], [])
    for lm, sd in ((col, col_sd), (row, row_sd)):
        back = lm.state_dict()
        assert list(back) == list(sd)
        for k, v in sd.items():
            assert torch.equal(back[k], v), f"{k} did not round-trip"
    bias = local.bias.detach()
    torch.testing.assert_close(run(col, row, bias, x), local(x), atol=1e-5, rtol=0)


# ---- the intermediate activation never reaches the caller --------------------------------------


def records() -> dict[str, dict]:
    return {w: remote.records() if w == "worker0" else rpc.rpc_sync(w, remote.records) for w in WORKERS}


def clear_records() -> None:
    remote.clear_records()
    for w in WORKERS[1:]:
        rpc.rpc_sync(w, remote.clear_records)


@pytest.fixture
def recorders():
    clear_records()
    # positive control of the recorder itself: a Tracer that does come to the caller is seen
    rpc.rpc_sync("worker1", remote.make_tracer)
    assert remote.records()["arrivals"] == ["worker0"]
    clear_records()
    yield
    clear_records()


def test_the_intermediate_activation_is_never_unpickled_on_the_caller(recorders):
    """Forward only (a tensor subclass breaks distributed autograd's backward)."""
    local = LocalMLP(HIDDEN[2])
    col, row, bias = sharded(local, MESHES[2], TracingColumnShard, RecordingRowShard)
    x = torch.randn(BATCH, D_IN)
    torch.testing.assert_close(run(col, row, bias, x), local(x), atol=1e-5, rtol=0)
    seen = records()
    assert seen["worker0"]["arrivals"] == [], "the column-parallel output was unpickled on the caller"
    for w in ("worker1", "worker2"):
        assert seen[w]["arrivals"] == [], f"the column-parallel output travelled to {w}"
        # the row shard received the very tensor (a Tracer) its worker's column shard made
        [made] = seen[w]["produced"]
        assert seen[w]["received"] == [("Tracer", made)]
    # positive control: fetching the intermediate does unpickle it on the caller, once per shard
    clear_records()
    h = col(x)
    shards = h.local_shards()
    torch.testing.assert_close(torch.cat(shards, dim=1), torch.relu(local.col(x)), atol=1e-5, rtol=0)
    assert records()["worker0"]["arrivals"] == ["worker0", "worker0"]


def test_nor_under_distributed_autograd_the_row_shard_computes_on_the_column_shards_own_tensor(recorders):
    local = LocalMLP(HIDDEN[2])
    mesh = MESHES[2]
    col, row, bias = sharded(local, mesh, PtrColumnShard, RecordingRowShard)
    x, target = torch.randn(BATCH, D_IN), torch.randn(BATCH, D_OUT)
    F.mse_loss(local(x), target).backward()
    with dist_autograd.context() as ctx:
        dist_autograd.backward(ctx, [F.mse_loss(run(col, row, bias, x), target)])
        grads = [rpc.rpc_sync(p.owner(), remote.gradient_of, (p, ctx)) for p in col.remote_parameters()]
    torch.testing.assert_close(torch.cat(grads[0::2], dim=0), local.col.weight.grad, atol=1e-5, rtol=0)
    seen = records()
    for w in mesh:
        [made] = seen[w]["produced"]
        assert seen[w]["received"] == [("Tensor", made)], f"{w}'s row shard computed on a copy"
    # positive control: an activation that went through the caller arrives as a different tensor
    clear_records()
    with torch.no_grad():
        h = col(x)
        row(distribute(h.full_tensor(), mesh, Shard(-1)))
    seen = records()
    for w in mesh:
        [made] = seen[w]["produced"]
        [(kind, got)] = seen[w]["received"]
        assert got != made


# ---- a training loop does not grow the hosts' shard stores ---------------------------------------


def held_counts() -> dict[str, int]:
    return {w: remote.held_count() if w == "worker0" else rpc.rpc_sync(w, remote.held_count) for w in WORKERS}


def settled_held_counts() -> dict[str, int]:
    """The hosts' store sizes once earlier tests' releases have landed: this process has no
    release left to send, and two reads more than a release delay apart agree (polled; a read
    goes to each host after the releases sent there)."""
    deadline = time.monotonic() + HANG_S
    before = held_counts()
    while True:
        time.sleep(3 * RELEASE_DELAY_S)  # the releaser's own delay: a release in the making gets out
        now = held_counts()
        if now == before and _releaser._queue.empty() and not _releaser._pending:
            return now
        assert time.monotonic() < deadline, f"hang guard: the hosts' store sizes never settled: {before} -> {now}"
        before = now


def test_a_training_loop_does_not_grow_the_hosts_shard_stores():
    n = 3
    gc.collect()
    baseline = settled_held_counts()
    local = LocalMLP(HIDDEN[n])
    col, row, bias = sharded(local, MESHES[n])
    dist_opt = DistributedOptimizer(torch.optim.SGD, col.remote_parameters() + row.remote_parameters()
                                    + [rpc.RRef(bias)], lr=0.05)
    held_mid = None
    for step in range(20):
        x, target = torch.randn(BATCH, D_IN), torch.randn(BATCH, D_OUT)
        with dist_autograd.context() as ctx:
            h = col(x)
            out = row(h)
            if step == 10:  # positive control: what a step holds is counted
                held_mid = held_counts()
            dist_autograd.backward(ctx, [F.mse_loss(out.full_tensor() + bias, target)])
            dist_opt.step(ctx)
    assert all(held_mid[w] >= baseline[w] + 2 for w in MESHES[n]), (baseline, held_mid)
    del h, out  # no gc.collect(): shards must be freed when dropped, not at the next cyclic collection
    deadline = time.monotonic() + HANG_S
    while True:
        now = held_counts()
        if all(now[w] <= baseline[w] for w in WORKERS) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert all(now[w] <= baseline[w] for w in WORKERS), (
        f"shard stores grew (polled up to the hang guard): baseline {baseline}, after {now}")


def test_caller_parameters_given_whole_get_their_gradients_as_locally():
    # torch RPC sends an nn.Parameter detached (pytorch/pytorch#86525); found porting a
    # sequence-parallel norm whose weight the caller holds
    x = torch.arange(8.0).view(4, 2)
    want = x.sum(0)  # d/dw of (x * w).sum()
    for placement, give in ((Replicate(), lambda w: w), (None, lambda w: w),
                            (None, lambda w: distribute(w, MESHES[2], Replicate()))):
        w = nn.Parameter(torch.ones(2))
        lm = LocalModule(MESHES[2], remote.Scale, in_placements=[Shard(0), placement], out_placements=Shard(0))
        with dist_autograd.context() as ctx:
            dist_autograd.backward(ctx, [lm(x, give(w)).full_tensor().sum()])
            got = dist_autograd.get_gradients(ctx).get(w)
        assert got is not None and torch.equal(got, want), (placement, got)

