"""Shard checkpoints across simulated machines (tests/_machines.py), each machine with a disk of
its own (issue 44, item 2): machine0 runs ps0, machine1 ps1, machine2 trainer0, and each
machine's own host directory is mounted at one path (DISK), as each machine's local disk would
be. An incremental save on the local one is laid out the same way, and loads its chain with
each server reading its own disk's base and changes. The job is
tests/ps/_shard_machines_job.py under a static three-machine torchrun.

In the local layout every server machine's disk holds only its own server's files and the
trainer's only the manifest and the trainer's files; a load into fresh tables on the same
servers gives back what was saved, bit for bit. Each machine sees only its own disk, so the load
succeeding shows that no server read another machine's files. The shared layout, whose path
must be one directory every machine reaches, is refused there with an error naming a file its
servers cannot see, and nothing is loaded. Needs root, ``ip``, ``unshare`` and ``mount``; skips
with the reason elsewhere (CI runs as root).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests import _machines
from tests._deadlines import HANG_S, SETUP_S
from tests.ps.test_table_checkpoints import same
from tests.test_torchrun import _argv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(SETUP_S + HANG_S)]

PORT = "29400"  # each machine is a fresh network namespace: every port is free
SERVERS = {"machine0": "ps0", "machine1": "ps1"}
TRAINER = "machine2"


@pytest.fixture(scope="module")
def three_disks(tmp_path_factory):
    """The job run once on three machines with a disk each: ``(disk directories by hostname,
    the job's out directory, its report)``."""
    reason = _machines.missing_requirements() or (None if shutil.which("mount") else "no `mount` on PATH")
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("disks")
    disk, out = tmp / "disk", tmp / "out"  # DISK: each machine's own directory is mounted here
    disk.mkdir()
    out.mkdir()
    with _machines.machines(3) as cluster:
        own = {m: tmp / m.hostname for m in cluster.machines}
        for path in own.values():
            path.mkdir()
        commands = {m: _argv(f"torchrun --nnodes=3 --nproc-per-node=1 --node-rank={m.index} --master-addr=machine0 "
                             f"--master-port={PORT} -m tests.ps._shard_machines_job --disk {disk} --out {out}")
                    for m in cluster.machines}
        job = cluster.run(commands, env=_machines.clean_env(), mounts={m: {disk: own[m]} for m in cluster.machines})
        job.wait(SETUP_S + HANG_S)
        report = job.report()
        assert job.returncodes() == [0, 0, 0], report
    assert not list(disk.iterdir()), "a machine wrote to the host's DISK, not its own"
    return {m.hostname: path for m, path in own.items()}, out, report


def _files(root: Path) -> set[str]:
    """The files under ``root``, relative to it."""
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_each_machine_holds_only_its_own_files_and_the_load_restores_bit_for_bit(three_disks):
    disks, out, report = three_disks
    got = torch.load(out / "local.pt", weights_only=False)
    listed = got["manifest"]["files"]
    # every server machine's disk holds its own server's folder, every file of it in the manifest
    for hostname, server in SERVERS.items():
        mine = _files(disks[hostname] / "local")
        assert mine and all(f.startswith(f"{server}/") for f in mine), (hostname, mine)
        assert mine == {rel for rel, e in listed.items() if e["server"] == server}, (hostname, mine)
    # the trainer's disk: the manifest and the trainer's files (its state of each table, the
    # eager weights' metadata for dcp.load), nothing of a server
    trainers = _files(disks[TRAINER] / "local")
    assert trainers == {"manifest.json"} | {rel for rel, e in listed.items() if e["server"] is None}, trainers
    assert {"eager.trainer.pt", "lazy.trainer.pt"} <= trainers, trainers
    # fresh tables on the same servers, loaded: bit for bit what was saved
    same(got["after"], got["before"], "local layout, loaded into fresh tables on the same servers")


def test_an_incremental_save_on_machines_own_disks_holds_each_servers_changes_there_and_loads_its_chain(
        three_disks):
    disks, out, report = three_disks
    got = torch.load(out / "local-inc.pt", weights_only=False)
    manifest = got["manifest"]
    assert manifest["base"]["path"] == "../local", manifest["base"]
    for key in ("eager", "lazy"):
        parts = manifest["tables"][key]["servers"]
        assert manifest["tables"][key]["incremental"] and all(p["since"] is not None for p in parts.values()), parts
    for hostname, server in SERVERS.items():  # (by id, its own folder on its own disk: no .distcp)
        mine = _files(disks[hostname] / "local-inc")
        assert mine == {rel for rel, e in manifest["files"].items() if e["server"] == server}, (hostname, mine)
        assert not any(f.endswith(".distcp") for f in mine), mine
    assert not any(f.startswith(tuple(SERVERS.values())) for f in _files(disks[TRAINER] / "local-inc"))
    # each server read its own disk's base and changes: the chain loaded bit for bit
    same(got["after"], got["before"], "incremental local save, loaded into fresh tables on the same servers")


def test_a_shared_checkpoint_on_machines_own_disks_is_refused_and_never_loads(three_disks):
    disks, out, report = three_disks
    got = torch.load(out / "shared.pt", weights_only=False)
    # the save was refused (below), so every load of it is refused as torn, nothing loaded
    for what in ("same", "swapped", "sketched"):
        error = got[what]
        assert error is not None and error.startswith("CheckpointError: ") and "torn" in error, (what, error, report)
        same(got[f"{what}-after"], got[f"{what}-before"], f"{what}: nothing loaded")
    # each server's files went to its own disk; the trainer wrote no manifest
    assert _files(disks["machine0"] / "shared") == {"eager.ps0.pt", "eager.ps0.distcp", "lazy.ps0.pt"}
    assert "manifest.json" not in _files(disks[TRAINER] / "shared")


def test_a_shared_layout_save_the_servers_wrote_where_the_trainer_cannot_see_is_refused(three_disks):
    # the shared layout promises one directory every server and the trainer reach at that path:
    # here each server wrote its files on its own disk, so the trainer sees none of them before
    # it would write the manifest, and refuses, naming one (the save stays torn, never loaded)
    disks, out, report = three_disks
    got = torch.load(out / "shared.pt", weights_only=False)
    assert got["save"] is not None and got["save"].startswith("CheckpointError: "), (
        f"save_shards(layout='shared') returned where the trainer sees none of the servers' files; a load onto the "
        f"same servers then gave: {got['same']!r}")
