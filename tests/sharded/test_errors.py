"""remote_module.sharded's errors: every bad input gets a TypeError/ValueError (RuntimeError
for mesh_rank() outside a shard) naming the item, what was expected and what was received;
a shard module's own error keeps its type and names the worker."""

import pickle
import re

import pytest
import torch
import torch.distributed.rpc as rpc
from torch.distributed.tensor import Partial, Replicate, Shard

from remote_module.sharded import LocalModule, distribute, from_local, mesh_rank, mesh_size
from tests.sharded import _remote as sr

pytestmark = pytest.mark.usefixtures("rpc_world")

MESH = ["worker1", "worker2"]


def raises(exc, *parts):
    """pytest.raises(exc) whose message contains every one of ``parts`` (literally)."""
    return pytest.raises(exc, match="(?s)" + "".join(f"(?=.*{re.escape(p)})" for p in parts))


@pytest.fixture(scope="module")
def echo2():
    """Two inputs: x by Shard(0), the second as it is."""
    return LocalModule(MESH, sr.Mixed, out_placements=[Shard(0)], in_placements=[Shard(0), None])


@pytest.fixture(scope="module")
def x():
    return distribute(torch.arange(6.0), MESH, Shard(0))


# ---- counts -----------------------------------------------------------------------------


@pytest.mark.parametrize("inputs", [(), (torch.ones(2),), (torch.ones(2), 1, 2)], ids=len)
def test_input_count_against_in_placements(echo2, inputs):
    with raises(ValueError, "LocalModule expects 2 input(s) (one per in_placements entry)", f"got {len(inputs)}"):
        echo2(*inputs)


@pytest.mark.parametrize("kind,declared,exc,text", [
    ("two", 1, ValueError, "returned 2 output(s), but out_placements declares 1"),
    ("two-on-last", 1, ValueError, "returned 2 output(s), but out_placements declares 1"),
    ("two", 3, ValueError, "returned 2 output(s), but out_placements declares 3"),
    ("int", 2, TypeError, "is int: 3; every output with a declared placement must be a tensor"),
])
def test_output_count_against_out_placements_is_checked_on_the_host(x, kind, declared, exc, text):
    lm = LocalModule(MESH, sr.Returns, (kind,), out_placements=[Shard(0)] * declared)
    with raises(exc, text) as info:
        lm(x)
    # whichever rank failed first (both do, except for two-on-last) is named with its worker
    rank = int(re.search(r"mesh rank (\d)", str(info.value)).group(1))
    assert rank == 1 if kind == "two-on-last" else rank in (0, 1)
    assert f"raised on worker {MESH[rank]!r}" in str(info.value)


# ---- Shard dims and shapes ----------------------------------------------------------------


@pytest.mark.parametrize("shape,dim,valid", [((3,), 1, "-1..0"), ((3,), -2, "-1..0"), ((2, 3), 2, "-2..1")])
def test_shard_dim_out_of_range_in_distribute_and_from_local(shape, dim, valid):
    expected = [f"Shard({dim}) is out of range for a tensor with {len(shape)} dimension(s)", f"valid dims: {valid}"]
    with raises(ValueError, "distribute", *expected):
        distribute(torch.zeros(shape), MESH, Shard(dim))
    with raises(ValueError, *expected):
        from_local(sr.different_shapes, MESH, Shard(dim), args=([shape, shape],))
    with raises(ValueError, "0-d tensor cannot be sharded (Shard(0))"):
        distribute(torch.tensor(1.0), MESH, Shard(0))


def test_shard_dim_out_of_range_in_out_placements_in_placements_and_redistribute(x):
    lm = LocalModule(MESH, sr.Returns, ("1d",), out_placements=[Shard(1)])
    with raises(ValueError, "LocalModule output 0 (Shard(1))", "out of range for a tensor with 1 dimension(s)"):
        lm(x)
    bad_in = LocalModule(MESH, sr.Echo, out_placements=[Shard(0)], in_placements=[Shard(1)])
    for value in (x, torch.arange(6.0)):  # a RemoteTensor, a caller tensor
        with raises(ValueError, "in_placements[0]", "Shard(1) is out of range for a tensor with 1 dimension(s)"):
            bad_in(value)
    with raises(ValueError, "redistribute", "Shard(-2) is out of range for a tensor with 1 dimension(s)"):
        x.redistribute(Shard(-2))


@pytest.mark.parametrize("placement,shapes,parts", [
    (Shard(0), [[2, 3], [2, 4]], ["Shard(0): every rank's shard must match rank 0's shape (2, 3) except on dim 0",
                                  "rank 1 holds (2, 4)"]),
    (Shard(1), [[2, 3], [3, 3]], ["rank 0's shape (2, 3) except on dim 1", "rank 1 holds (3, 3)"]),
    (Shard(0), [[2, 3], [2]], ["rank 0's shape (2, 3)", "rank 1 holds (2,)"]),
    (Replicate(), [[2, 3], [3, 3]], ["Replicate(): every rank must hold the same shape", "rank 0 holds (2, 3)",
                                     "rank 1 holds (3, 3)"]),
    (Partial("sum"), [[2], [3]], ["Partial(sum): every rank must hold the same shape", "rank 1 holds (3,)"]),
])
def test_shapes_that_cannot_be_sharded_as_asked(placement, shapes, parts):
    with raises(ValueError, *parts):
        from_local(sr.different_shapes, MESH, placement, args=(shapes,))


def test_outputs_whose_shapes_do_not_fit_their_placement(x):
    lm = LocalModule(MESH, sr.Returns, ("rank-shapes",), out_placements=[Replicate()])
    with raises(ValueError, "LocalModule output 0 (Replicate())", "rank 0 holds (2, 1) and rank 1 holds (2, 2)"):
        lm(x)


# ---- meshes -----------------------------------------------------------------------------


@pytest.mark.parametrize("mesh,exc,parts", [
    (["worker1", "nope"], ValueError, ["mesh[1] = 'nope' is not a worker of this RPC world", "worker1, worker2"]),
    (["worker1", 9], ValueError, ["mesh[1] = 9 is not a worker of this RPC world"]),
    (["worker1", "worker1"], ValueError, ["mesh[1] = 'worker1' names worker 'worker1' twice"]),
    (["worker1", 1], ValueError, ["mesh[1] = 1 names worker 'worker1' twice"]),
    ([], ValueError, ["mesh must name at least one worker, got an empty list"]),
    ("worker1", TypeError, ["mesh must be a list of worker names", "got str: 'worker1'"]),
    (["worker1", 1.5], TypeError, ["mesh[1] must be a worker name or rank, got float: 1.5"]),
])
def test_bad_meshes(mesh, exc, parts):
    with raises(exc, *parts):
        distribute(torch.ones(2), mesh, Replicate())
    with raises(exc, *parts):
        from_local(sr.position, mesh, Replicate())
    with raises(exc, *parts):
        LocalModule(mesh, sr.Echo, out_placements=[Replicate()])


@pytest.mark.parametrize("mesh", [["worker2", "worker1"], ["worker1"]], ids=str)
def test_inputs_on_another_mesh(echo2, mesh):
    other = distribute(torch.arange(6.0), mesh, Shard(0))
    expected = [f"lives on mesh {mesh}", "this LocalModule's mesh is ['worker1', 'worker2']",
                "same workers, same order"]
    with raises(ValueError, "LocalModule input 0", *expected):
        echo2(other, 1.0)  # declared Shard(0)
    with raises(ValueError, "LocalModule input 1", *expected):
        echo2(torch.ones(2), other)  # declared None
    with raises(ValueError, "LocalModule keyword argument 'z'", *expected):
        echo2(torch.ones(2), 1.0, z=other)  # a keyword


# ---- placements ----------------------------------------------------------------------------


def test_non_tensor_where_a_placement_is_declared(echo2):
    with raises(TypeError, "LocalModule input 0 has in_placements[0] = Shard(0)", "must be a tensor or a RemoteTensor",
                "got int: 3", "declare None"):
        echo2(3, 1.0)
    with raises(TypeError, "distribute: tensor must be a torch.Tensor, got list"):
        distribute([1.0, 2.0], MESH, Shard(0))
    with raises(TypeError, "from_local", "not_a_tensor(...) must return a tensor on every worker, got int: 3"):
        from_local(sr.not_a_tensor, MESH, Replicate())
    with raises(TypeError, "from_local: item 1 must be an RRef[Tensor], got Tensor"):
        from_local([rpc.remote("worker1", torch.ones, ((2,),)), torch.ones(2)], MESH, Replicate())
    with raises(TypeError, "from_local: an RRef must hold a tensor, got RRef[int]"):
        from_local([rpc.RRef(1), rpc.remote("worker2", torch.ones, ((2,),))], ["worker0", "worker2"], Replicate())
    with raises(TypeError, "from_local takes a module-level function or a list of RRef[Tensor]", "got int"):
        from_local(5, MESH, Replicate())


def test_partial_avg_needs_a_floating_dtype():
    expected = "Partial(avg) needs a floating-point tensor, got dtype torch.int64"
    with raises(ValueError, "distribute", expected):
        distribute(torch.arange(4), MESH, Partial("avg"))
    with raises(ValueError, expected):
        from_local(sr.int_shard, MESH, Partial("avg"))
    ints = from_local(sr.int_shard, MESH, Partial("sum"))
    with raises(ValueError, "redistribute(placement)", expected):
        ints.redistribute(Partial("avg"))
    lm = LocalModule(MESH, sr.Echo, out_placements=[Replicate()], in_placements=[Partial("avg")])
    with raises(ValueError, "in_placements[0]", expected):
        lm(torch.arange(4))


@pytest.mark.parametrize("placement,exc,parts", [
    (Partial("prod"), ValueError, ["Partial('prod') is not supported; reduce ops: sum, avg, max, min"]),
    ([Shard(0), Replicate()], ValueError,
     ["a 1-D mesh takes one placement, got a sequence of 2", "pass e.g. Shard(0)"]),
    ([], ValueError, ["a 1-D mesh takes one placement, got a sequence of 0"]),
    ("Shard(0)", TypeError, ["must be torch.distributed.tensor.Shard(dim), Replicate() or Partial(op)", "got str"]),
])
def test_bad_placements(x, placement, exc, parts):
    with raises(exc, *parts):
        distribute(torch.ones(2), MESH, placement)
    with raises(exc, *parts):
        from_local(sr.position, MESH, placement)
    with raises(exc, "redistribute(placement)", *parts):
        x.redistribute(placement)
    with raises(exc, "out_placements[0]", *parts):
        LocalModule(MESH, sr.Echo, out_placements=[placement])
    with raises(exc, "in_placements[0]", *parts):
        LocalModule(MESH, sr.Echo, out_placements=[Replicate()], in_placements=[placement])


def test_local_module_constructor_arguments():
    with raises(TypeError, "out_placements is required"):
        LocalModule(MESH, sr.Echo, out_placements=None)
    with raises(TypeError, "args(0) must return a pair (args tuple, kwargs dict or None), got 7"):
        LocalModule(MESH, sr.Echo, lambda r: 7, out_placements=[Replicate()])
    with raises(TypeError, "LocalModule: args must be a tuple or a callable rank -> (args, kwargs), got int"):
        LocalModule(MESH, sr.Echo, 3, out_placements=[Replicate()])


# ---- the rest ------------------------------------------------------------------------------


def test_a_remote_tensor_does_not_pickle(x):
    with raises(TypeError, "a RemoteTensor cannot be pickled or sent over RPC", "send rt.full_tensor()"):
        pickle.dumps(x)
    with raises(TypeError, "a RemoteTensor cannot be pickled or sent over RPC"):
        rpc.rpc_sync("worker1", sr.held_count, (x,))


def test_mesh_position_outside_a_shard():
    for fn in (mesh_rank, mesh_size):
        with raises(RuntimeError, f"{fn.__name__}() is only valid while a shard runs on its worker"):
            fn()
    with raises(RuntimeError, "mesh_rank() is only valid while a shard runs on its worker"):
        rpc.rpc_sync("worker1", sr.call_mesh_rank)


def test_a_module_raising_on_one_worker_keeps_its_type_and_names_the_worker(x):
    lm = LocalModule(MESH, sr.FailOnRank, (1,), out_placements=[Shard(0)])
    with raises(sr.UserError, "shard 1 refuses", "'worker2'"):
        lm(x)


def test_output_structures_that_differ_across_ranks(x):
    lm = LocalModule(MESH, sr.Returns, ("per-rank",), out_placements=[Shard(0)] * 2)
    with raises(ValueError, "differently structured outputs", "mesh rank 0 returned ('tuple', [None, None])",
                "mesh rank 1 returned ('list', [None, None])"):
        lm(x)
