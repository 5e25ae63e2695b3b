"""The sharded layer attacked as an ordinary user would: replicated outputs in training,
redistribute's memory, the caller as a mesh member. Each test checks against a local
reference or a figure that a correct implementation must meet."""

import time

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.tensor import Partial, Replicate, Shard

from remote_module.sharded import LocalModule, distribute
from tests import _sharded_hostile_remote as hr

pytestmark = pytest.mark.usefixtures("rpc_world")

MESH = ["worker1", "worker2"]


def weights(lm: LocalModule) -> list[torch.Tensor]:
    sd = lm.state_dict()
    return [sd[f"shards.{r}.weight"] for r in range(len(lm.mesh))]


def test_replicate_output_trains_every_replica():
    """A Replicate output is one value held by every worker: a loss on its full_tensor() must
    train every worker's copy of a replicated parameter, as one local module would be
    trained (fetching only rank 0's copy left the other replicas untrained and diverging)."""
    torch.manual_seed(0)
    w, x = torch.randn(3, 3), torch.randn(4, 3)
    local = hr.Affine(w)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.1)
    lm = LocalModule(MESH, hr.Affine, (w,), in_placements=[Replicate()], out_placements=Replicate())
    opt = DistributedOptimizer(torch.optim.SGD, lm.remote_parameters(), lr=0.1)
    for _ in range(2):
        with dist_autograd.context() as ctx:
            out = lm(x).full_tensor()
            dist_autograd.backward(ctx, [(out * out).sum()])
            opt.step(ctx)
        local_opt.zero_grad()
        (local(x) ** 2).sum().backward()
        local_opt.step()
    for r, got in enumerate(weights(lm)):
        torch.testing.assert_close(got, local.weight.detach(), atol=1e-5, rtol=0, msg=lambda m: f"replica {r}: {m}")


@pytest.mark.parametrize("dst", [Shard(0), Partial("sum"), Partial("avg")], ids=["Shard0", "Psum", "Pavg"])
def test_redistribute_from_replicate_trains_every_replica(dst):
    """Replicate -> Shard/Partial slices (or keeps) each worker's own copy, no traffic; under
    autograd every replica must still receive its whole gradient (each got its own slice's only,
    so the replicas of one parameter diverged from the local model and from each other)."""
    torch.manual_seed(1)
    w, x = torch.randn(3, 3), torch.randn(4, 3)
    local = hr.Affine(w)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.1)
    lm = LocalModule(MESH, hr.Affine, (w,), in_placements=[Replicate()], out_placements=Replicate())
    opt = DistributedOptimizer(torch.optim.SGD, lm.remote_parameters(), lr=0.1)
    for _ in range(2):
        with dist_autograd.context() as ctx:
            out = lm(x).redistribute(dst).full_tensor()
            dist_autograd.backward(ctx, [(out * out).sum()])
            opt.step(ctx)
        local_opt.zero_grad()
        (local(x) ** 2).sum().backward()
        local_opt.step()
    for r, got in enumerate(weights(lm)):
        torch.testing.assert_close(got, local.weight.detach(), atol=1e-5, rtol=0, msg=lambda m: f"replica {r}: {m}")


def test_replicate_output_full_tensor_is_rank0s_value_exactly():
    """The fetch of every replica (for gradients) returns rank 0's value bit for bit (inf and
    -0.0 included), and outside autograd the result is still a caller-owned copy."""
    t = torch.tensor([float("inf"), -0.0, 1.5])
    rt = distribute(t.clone().requires_grad_(), MESH, Replicate())
    got = rt.full_tensor()
    assert torch.equal(got, t) and torch.equal(torch.signbit(got), torch.signbit(t))


def test_replicate_to_shard_keeps_only_its_part():
    """Redistributing Replicate -> Shard(0) and dropping the replicated tensor must leave each
    worker holding its rows only, not a view that keeps the whole replicated storage alive."""
    big = distribute(torch.zeros(1000, 100), MESH, Replicate())
    rows = big.redistribute(Shard(0))
    del big
    held = [rpc.rpc_sync(w, hr.storage_bytes, (sid,)) for w, sid in zip(MESH, rows._sids)]
    assert held == [500 * 100 * 4] * 2, f"workers keep {held} bytes for their 500 rows (want 200000 each)"
    assert rows.full_tensor().shape == (1000, 100)


def test_caller_as_mesh_member_holds_copies():
    """worker0 (the caller) in the mesh: its shard is a copy of what it distributed, and what
    full_tensor() returns is the caller's own (in-place changes on either side stay there)."""
    t = torch.zeros(4)
    rt = distribute(t, ["worker0", "worker1"], Replicate())
    t.add_(1)
    got = rt.full_tensor()
    got.add_(5)
    assert [s.tolist() for s in rt.local_shards()] == [[0.0] * 4, [0.0] * 4]
