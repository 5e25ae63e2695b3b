"""Every public class copies and pickles (issue 43, item 5), without an RPC world.

For each class in the ``__all__`` of ``remote_module``, ``remote_module.ps``,
``remote_module.pipeline``, ``remote_module.sharded``, ``remote_module.serving`` and ``rpc_backend``, :data:`BUILT`
gives a way to build one here, or :data:`NEEDS_A_WORLD` says why there is none. Each built
object goes through ``copy.copy``, ``copy.deepcopy`` and a ``pickle`` round trip and comes back
equal (by :func:`_same`); none of them refuses.

The classes whose instances need a world are covered by the tests that build them:

- ``RemoteModule``: plain ``pickle``/``torch.save`` refuse with torch's text and what to do,
  and over RPC it travels as a handle (tests/proxy/test_pickling.py); ``copy.deepcopy``
  copies the module on its host (tests/proxy/test_freeze_cast_copy.py); ``copy.copy``
  refuses as pickle does (below);
- ``RemotePipeline``: ``copy.deepcopy`` (tests/pipeline/test_module.py), pickled to another
  caller over RPC (tests/pipeline/test_edge_cases.py);
- ``LocalModule``: ``copy.deepcopy`` (tests/sharded/test_over_rpc.py);
- ``ReplicatedModule``: travels over RPC as the same replicas; ``pickle`` and ``copy.deepcopy``
  refuse, saying to save its ``state_dict()`` (tests/serving/test_replicas.py);
- ``RemoteTensor``: refuses ``pickle``, saying what to send instead (tests/sharded/test_errors.py);
- ``PSModel``: ``copy.deepcopy`` and ``pickle`` (tests/ps/test_in_flight_edges.py,
  tests/ps/test_lr_schedules.py); ``ShardedEmbedding`` and ``ShardedEmbeddingBag``: the same
  (tests/ps/test_embedding_edge_cases.py, tests/ps/test_table_training.py).
  ``ShardedEmbeddingBagCollection`` has no copy or pickle test yet (tests/ps/ is being
  reorganised; left to that change). ``Checkpointer`` has none either (it holds the objects
  it saves; copying it would copy them).
"""

from __future__ import annotations

import copy
import importlib
import inspect
import pickle
from typing import Any, Callable

import pytest

import remote_module
from rpc_backend import LostWorker
from rpc_backend._beats import Origin

PACKAGES = ("remote_module", "remote_module.ps", "remote_module.pipeline", "remote_module.sharded",
            "remote_module.serving", "rpc_backend")

_LOST = LostWorker("trainer1", 2, "trainer", Origin("machine1", "10.0.0.2", "1", 4242), "at step 3", "running", 10.5,
                   False)

#: "package.Name" -> a function that builds one without an RPC world
BUILT: dict[str, Callable[[], Any]] = {
    "remote_module.RemoteModuleError": lambda: remote_module.RemoteModuleError("ValueError: bad input on worker1"),
    "remote_module.CallTimeout": lambda: remote_module.CallTimeout("call to worker1 timed out after 2.0 s"),
    "remote_module.BatchPolicy": lambda: remote_module.BatchPolicy(dim=1, max_batch=16, max_wait_ms=0.5),
    "remote_module.serving.BatchPolicy": lambda: remote_module.BatchPolicy(),
    "remote_module.ps.Block": lambda: _cls("remote_module.ps.Block")(1, 10, 5),
    "remote_module.ps.RoundRobin": lambda: _cls("remote_module.ps.RoundRobin")(),
    "remote_module.ps.HashName": lambda: _cls("remote_module.ps.HashName")(),
    "remote_module.ps.StepRefused": lambda: _cls("remote_module.ps.StepRefused")("step 3 refused by ps0"),
    "remote_module.ps.StepNotApplied": lambda: _cls("remote_module.ps.StepNotApplied")("step 3 not applied on ps1"),
    "remote_module.ps.CheckpointError": lambda: _cls("remote_module.ps.CheckpointError")(
        "/ckpt/emb.ps1.pt: its checksum is crc32:000000ff, the manifest says crc32:0000ff00 (corrupt)"),
    "rpc_backend.Worker": lambda: _cls("rpc_backend.Worker")(
        "trainer0", 1, 3, 1, "trainer", 0, 2, names=["ps0", "trainer0", "trainer1"], shutdown_timeout=5.0,
        layout=_cls("rpc_backend.placements")(3, {"ps": 1, "trainer": 2})),
    "rpc_backend.BuildMismatch": lambda: _cls("rpc_backend.BuildMismatch")("0.1.0 on rank 0, 0.1.0+other on rank 1"),
    "rpc_backend.ConnectError": lambda: _cls("rpc_backend.ConnectError")("could not reach 10.0.0.1:29500"),
    "rpc_backend.LocalWorldError": lambda: _cls("rpc_backend.LocalWorldError")(1, "worker1", "Traceback ...", True),
    "rpc_backend.NetworkChoice": lambda: _cls("rpc_backend.NetworkChoice")("eth0", "10.0.0.2", "the default route"),
    "rpc_backend.RankPlacement": lambda: _cls("rpc_backend.RankPlacement")("trainer1", "trainer", 1, 2),
    "rpc_backend.Placement": lambda: _cls("rpc_backend.Placement")("ps0", "ps", 0, 1),
    "rpc_backend.WorkerLost": lambda: _cls("rpc_backend.WorkerLost")("lost trainer1 (rank 2)", [_LOST]),
    "rpc_backend.LostWorker": lambda: _LOST,
    "rpc_backend.Traffic": lambda: _counted_traffic(),
}

#: "package.Name" -> why there is no instance without an RPC world (see the module docstring)
NEEDS_A_WORLD: dict[str, str] = {
    "remote_module.RemoteModule": "creates its module on a host worker",
    "remote_module.ps.PSModel": "places its parameters on servers",
    "remote_module.ps.Checkpointer": "its trainers are the ranks of a world; it saves objects on servers",
    "remote_module.ps.ShardedEmbedding": "creates its table on servers",
    "remote_module.ps.ShardedEmbeddingBag": "creates its table on servers",
    "remote_module.ps.ShardedEmbeddingBagCollection": "holds tables, which need servers",
    "remote_module.pipeline.RemotePipeline": "creates its stages on workers",
    "remote_module.serving.ReplicatedModule": "creates its module on host workers",
    "remote_module.sharded.RemoteTensor": "its shards live on workers",
    "remote_module.sharded.LocalModule": "creates its shards on workers",
}

def _cls(dotted: str) -> Any:
    module, name = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def _counted_traffic() -> Any:
    traffic = _cls("rpc_backend.Traffic")()
    traffic.messages["worker1"] += 2
    traffic.sent["worker1"] += 300
    traffic.received["worker1"] += 120
    traffic.answers["worker1"] += 2
    traffic.unsized = 1
    return traffic


def _public_classes() -> list[str]:
    found = []
    for package in PACKAGES:
        module = importlib.import_module(package)
        found += [f"{package}.{name}" for name in module.__all__ if inspect.isclass(getattr(module, name))]
    return found


def _same(a: Any, b: Any) -> bool:
    """Equal as users see them: by ``==`` where the class defines it, else by type and the
    public attributes (an exception also by ``str`` and ``args``)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, BaseException):
        return str(a) == str(b) and a.args == b.args and _public_vars(a) == _public_vars(b)
    if type(a).__eq__ is not object.__eq__:
        return a == b
    return _public_vars(a) == _public_vars(b)


def _public_vars(obj: Any) -> dict:
    return {k: v for k, v in vars(obj).items() if not k.startswith("_")}


def test_every_public_class_is_in_one_table():
    names = _public_classes()
    assert len(names) >= 20
    assert sorted(names) == sorted({*BUILT, *NEEDS_A_WORLD}), "add the new public class to BUILT or NEEDS_A_WORLD"
    assert not set(BUILT) & set(NEEDS_A_WORLD)


ROUND_TRIPS: dict[str, Callable[[Any], Any]] = {
    "copy": copy.copy,
    "deepcopy": copy.deepcopy,
    "pickle": lambda obj: pickle.loads(pickle.dumps(obj)),
}


@pytest.mark.parametrize("how", ROUND_TRIPS)
@pytest.mark.parametrize("name", sorted(BUILT))
def test_copies_and_pickles_come_back_equal(name, how):
    original = BUILT[name]()
    back = ROUND_TRIPS[how](original)
    assert _same(back, original), (name, how, back, original)
    if how != "copy" and not isinstance(original, tuple):
        assert back is not original


def test_a_traffic_copy_is_a_snapshot_of_its_counts():
    traffic = _counted_traffic()
    snapshot = copy.deepcopy(traffic)
    traffic.sent["worker1"] += 1
    assert snapshot.sent["worker1"] == 300 and snapshot.answers["worker1"] == 2
    with snapshot:  # a working Traffic of its own (its own lock), counting from its counts
        pass
    assert snapshot.settle() is None


def test_a_proxy_refuses_copy_copy_as_it_refuses_pickle():
    # copy.copy of an nn.Module goes through __reduce_ex__, hence __getstate__, which a proxy
    # refuses with torch's text and what to do instead (no RPC needed to see it)
    from remote_module._proxy.pickling import NOT_PICKLABLE

    proxy = remote_module.RemoteModule.__new__(remote_module.RemoteModule)
    with pytest.raises(RuntimeError) as info:
        copy.copy(proxy)
    assert str(info.value) == NOT_PICKLABLE
