"""The layer map of shared/DESIGN.md holds in the source (imports only point down), and the
check fails on each kind of bad import planted in a copy of the source."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import remote_module
import rpc_backend
from tests._layers import violations

ROOT = Path(remote_module.__file__).resolve().parent.parent


def test_the_packages_sit_side_by_side():
    assert Path(rpc_backend.__file__).resolve().parent.parent == ROOT


def test_imports_only_point_down():
    assert violations(ROOT) == []


# (file, line planted at the end, a word of the rule it breaks)
PLANTED = [
    ("rpc_backend/roles.py", "import remote_module", "rpc_backend imports nothing"),
    ("remote_module/_core/walk.py", "def f():\n    from remote_module._proxy import wire",
     "_core imports nothing above"),
    ("remote_module/_core/errors.py", "from remote_module.ps import PSModel", "_core imports nothing above"),
    ("remote_module/_proxy/wire.py", "from remote_module.pipeline import RemotePipeline",
     "_proxy imports nothing above"),
    ("remote_module/pipeline/_split.py", "from remote_module.ps import PSModel", "pipeline never imports ps"),
    ("remote_module/sharded/_mesh.py", "from remote_module._core.fanout import call_all", "not its modules"),
    ("remote_module/ps/_rowwise.py", "from remote_module._core import _PACKAGE", "not in remote_module._core.__all__"),
    ("remote_module/ps/tables/server/_rows.py", "import remote_module._core", "not in remote_module._core.__all__"),
    ("remote_module/ps/_placement.py", "from remote_module._proxy._host import host_device", "not its modules"),
    ("remote_module/ps/dense/_server.py", "from remote_module.sharded._host import Ref", "ps never imports sharded"),
    ("remote_module/demos/hybrid.py", "from remote_module.ps._modes import PS_MODES", "public names only"),
    ("remote_module/sharded/_placements.py", "x = torch._C._get_tracing_state", "torch's private torch._C"),
    ("remote_module/pipeline/_balance.py", "from torch.distributed.rpc.api import RRef", "torch's private"),
    ("remote_module/ps/tables/server/_handlers.py", "rpc._get_current_rpc_agent()", "torch's private"),
    # relative imports, modules named after ``from package import``, literal dynamic imports
    ("remote_module/ps/_rowwise.py", "from ..sharded import _store", "ps never imports sharded"),
    ("remote_module/ps/_rowwise.py", "from .._core.fanout import call_all", "not its modules"),
    ("remote_module/_core/walk.py", "from .._proxy import wire", "_core imports nothing above"),
    ("remote_module/ps/tables/server/_rows.py", "from remote_module import sharded", "ps never imports sharded"),
    ("remote_module/ps/_rowwise.py", "from remote_module import _proxy", "not in remote_module._proxy.__all__"),
    ("remote_module/remote_module.py", "from remote_module import ps", "the proxy imports nothing above"),
    ("remote_module/demos/hybrid.py", "from remote_module.ps import _modes", "public names only"),
    ("remote_module/pipeline/_split.py", "from remote_module.demos import dlrm", "nothing below the demos"),
    ("remote_module/sharded/_mesh.py", "import importlib\nimportlib.import_module('remote_module._proxy.wire')",
     "not its modules"),
    # ps/'s inner map: dense/ and tables/ apart, the table server apart from the trainer side,
    # lifetime/ on row storage and initial rows only, the shared modules on each other only
    ("remote_module/ps/dense/_model.py", "from remote_module.ps.tables._embedding import ShardedEmbedding",
     "dense/ never imports tables/"),
    ("remote_module/ps/dense/_server.py", "from ..tables.server import _handlers", "dense/ never imports tables/"),
    ("remote_module/ps/dense/_pushes.py", "from remote_module.ps import tables", "dense/ never imports tables/"),
    ("remote_module/ps/tables/_collection.py", "from remote_module.ps.dense._model import PSModel",
     "tables/ never imports dense/"),
    ("remote_module/ps/tables/server/_handlers.py", "from remote_module.ps.tables._embedding import ShardedEmbedding",
     "tables/server/ never imports the trainer side"),
    ("remote_module/ps/tables/server/_table.py", "def f():\n    from .. import _prefetch",
     "tables/server/ never imports the trainer side"),
    ("remote_module/ps/tables/server/_rows.py",
     "import importlib\nimportlib.import_module('remote_module.ps.tables._embedding')",
     "tables/server/ never imports the trainer side"),
    ("remote_module/ps/tables/lifetime/_eviction.py", "from remote_module.ps.tables.server._table import Table",
     "tables/lifetime/ imports only row storage and initial rows"),
    ("remote_module/ps/tables/lifetime/_admission.py", "from remote_module.ps._modes import PS_MODES",
     "tables/lifetime/ imports only row storage and initial rows"),
    ("remote_module/ps/_steps.py", "from remote_module.ps.tables import _pushes", "shared modules import nothing"),
    ("remote_module/ps/_optimizer.py", "from remote_module.ps.dense._model import PSModel",
     "shared modules import nothing"),
    ("remote_module/ps/tables/_embedding.py", "from remote_module.ps import PSModel", "not remote_module.ps"),
    # checkpoint/ sits above the other parts: none of them imports it, and it imports none of
    # ps/ through remote_module.ps
    ("remote_module/ps/tables/_checkpoints.py", "from remote_module.ps.checkpoint._shards import save_shards",
     "tables/ never imports dense/ or checkpoint/"),
    ("remote_module/ps/tables/server/_shard_files.py", "from remote_module.ps.checkpoint import _manifest",
     "tables/server/ never imports the trainer side"),
    ("remote_module/ps/dense/_model.py", "from ..checkpoint._manifest import CheckpointError",
     "dense/ never imports tables/ or checkpoint/"),
    ("remote_module/ps/_options.py", "from remote_module.ps.checkpoint import _shards",
     "shared modules import nothing of dense/, tables/ or checkpoint/"),
    ("remote_module/ps/checkpoint/_shards.py", "from remote_module.ps import PSModel", "not remote_module.ps"),
    ("remote_module/ps/checkpoint/_manifest.py", "from remote_module.sharded._host import Ref",
     "ps never imports sharded"),
    ("remote_module/ps/checkpoint/_manifest.py", "from torch.distributed.checkpoint.filesystem import _StorageInfo",
     "torch's private"),
    ("remote_module/ps/checkpoint/_checkpointer.py", "from remote_module.ps import PSModel", "not remote_module.ps"),
]

# imports ps/'s inner map allows, planted where a rule applies: nothing is found
ALLOWED = [
    ("remote_module/ps/tables/lifetime/_deltas.py", "from remote_module.ps.tables.server._initial import mix64"),
    ("remote_module/ps/tables/server/_handlers.py", "from remote_module.ps.tables.lifetime import _deltas"),
    ("remote_module/ps/tables/_lookups.py", "from remote_module.ps._steps import Flight"),
    ("remote_module/ps/dense/_model.py", "from remote_module.ps._placement import place"),
    ("remote_module/ps/__init__.py", "from remote_module.ps.tables.server import _handlers"),
    ("remote_module/ps/checkpoint/_shards.py", "from remote_module.ps.dense._model import PSModel"),
    ("remote_module/ps/checkpoint/_shards.py", "from remote_module.ps.tables.lifetime import _deltas"),
    ("remote_module/ps/__init__.py", "from remote_module.ps.checkpoint import _shards"),
    ("remote_module/ps/checkpoint/_checkpointer.py", "from remote_module.ps._modes import PS_MODES"),
    ("remote_module/ps/checkpoint/_checkpointer.py", "from remote_module.ps.checkpoint import _checkpointer"),
]


@pytest.fixture(scope="module")
def copied(tmp_path_factory):
    """A copy of both packages' source, checked clean once."""
    root = tmp_path_factory.mktemp("src")
    for package in ("rpc_backend", "remote_module"):
        shutil.copytree(ROOT / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    assert violations(root) == []
    return root


@pytest.mark.parametrize("path,planted,rule", PLANTED, ids=[f"{p}:{r}" for p, _, r in PLANTED])
def test_a_planted_bad_import_is_found(copied, path, planted, rule):
    target = copied / path
    original = target.read_text()
    try:
        target.write_text(original + "\n" + planted + "\n")
        found = violations(copied)
    finally:
        target.write_text(original)
    assert len(found) == 1, found
    where, why = found[0].split(": ", 1)
    assert where.startswith(f"{path}:") and int(where.rsplit(":", 1)[1]) > len(original.splitlines()), found
    assert rule in why, found


@pytest.mark.parametrize("path,planted", ALLOWED, ids=[p for p, _ in ALLOWED])
def test_an_import_the_ps_map_allows_is_not_found(copied, path, planted):
    target = copied / path
    original = target.read_text()
    try:
        target.write_text(original + "\n" + planted + "\n")
        found = violations(copied)
    finally:
        target.write_text(original)
    assert found == []
