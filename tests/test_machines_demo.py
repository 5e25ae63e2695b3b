"""The click demo across 3 simulated machines (tests/_machines.py): the servers on one, a
trainer on each of the two others, as tutorials/torchrun.md starts it (the static form, each
machine its own ``torchrun`` and ``--nproc-per-node``), with no network variable set.

In sync mode the job is deterministic, so it must print the same figures as the same job under
``run_local`` on one machine: every step's loss, the training AUC curve and the held-out AUC of
each trainer, compared exactly (the demo's ``--json`` writes them at full precision). Why
exactly: a sync step applies the trainers' pushes on each server in trainer-name order
(remote_module/ps/tables/server/_table.py, ``Table._apply_step``), DDP's all-reduce over two trainers adds
two numbers (the same sum whichever comes first), and every draw comes from a generator seeded
per trainer; nothing in the arithmetic depends on where a rank runs or when a message lands.
``--threads`` is fixed on both sides: by default a rank takes the cores over its own machine's
processes, which differ between the launchers and could change a kernel's blocking.

Needs root, ``ip`` and ``unshare``; skips with the reason elsewhere (CI runs as root).
"""

import json
import re
import subprocess
import sys

import pytest

from tests import _machines
from tests._deadlines import HANG_S, SETUP_S
from tests.test_torchrun import DLRM_COMMANDS, _argv

#: two jobs, one after the other, each bounded by JOB_S
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * (SETUP_S + HANG_S) + 300)]

PORT = "29400"  # each machine is a fresh network namespace: every port is free
#: a job: its world forms, then a few seconds of work
JOB_S = SETUP_S + HANG_S
#: the same options for both launchers: a short run (20 steps; the tables are the demo's own),
#: no progress bars, no PNG
OPTIONS = ["--mode", "sync", "--steps", "20", "--threads", "1", "--no-progress", "--plot", ""]
#: what is compared, per trainer: the figures that depend on training (not on speed)
FIGURES = ("trainer", "steps", "losses", "loss_first", "loss_last", "auc_curve", "auc_train", "auc")


def _summary_rows(stdout: str) -> list[list[str]]:
    """The summary's trainer rows as printed: name, loss first, ->, last, train AUC, held-out AUC."""
    return [line.split()[:6] for line in stdout.splitlines() if re.match(r"trainer\d +\d", line)]


def test_sync_demo_with_the_servers_on_their_own_machine_equals_run_local(can_build_machines, tmp_path):
    commands = DLRM_COMMANDS[2:]  # the guide's three-machine commands, --node-rank=0, 1, 2
    assert len(commands) == 3 and all(f"--node-rank={i}" in c for i, c in enumerate(commands)), commands
    local_json, spread_json = tmp_path / "local.json", tmp_path / "machines.json"

    # the same job on one machine, started by run_local: 2 servers, 2 trainers, same seeds
    local = subprocess.run([sys.executable, "-m", "remote_module.demos.dlrm", "--servers", "2", "--trainers", "2",
                            *OPTIONS, "--json", str(local_json)],
                           cwd=tmp_path, env=_machines.clean_env(), capture_output=True, text=True, timeout=JOB_S)
    assert local.returncode == 0, local.stdout[-3000:] + local.stderr[-3000:]

    with _machines.machines(3) as cluster:
        host0 = cluster.machines[0].hostname
        argvs = {m: _argv(c, HOST0=host0, PORT=PORT) + OPTIONS + ["--json", str(spread_json)]
                 for m, c in zip(cluster.machines, commands)}
        job = cluster.run(argvs, env=_machines.clean_env(), cwd=tmp_path).wait(JOB_S)
        assert job.returncodes() == [0, 0, 0], job.report()
        servers, first, second = (p.stdout() for p in job.processes)

    # the placement: ranks 0 and 1 (the servers, which print nothing) on the first machine,
    # trainer0 on the second (it prints the one summary), trainer1 on the third
    assert not re.search(r"^trainer\d", servers, re.M) and "DLRM click model" not in servers, job.report()
    assert "trainer0: finished" in first and "trainer1:" not in first, job.report()
    assert "trainer1: finished" in second and "trainer0:" not in second, job.report()
    assert first.count("DLRM click model: 2 parameter servers, 2 trainers, mode sync, 20 steps") == 1, job.report()

    local_figures, spread_figures = (json.loads(path.read_text()) for path in (local_json, spread_json))
    assert [r["trainer"] for r in spread_figures] == ["trainer0", "trainer1"], spread_figures
    # not vacuous: 20 losses per trainer, the trainers' batches differ, and the tables trained
    for r in local_figures:
        assert len(r["losses"]) == 20 and r["loss_last"] < r["loss_first"], r
    assert local_figures[0]["losses"] != local_figures[1]["losses"]
    # the same figures, exactly (see the module's docstring for why no tolerance)
    for mine, theirs in zip(spread_figures, local_figures, strict=True):
        assert {k: mine[k] for k in FIGURES} == {k: theirs[k] for k in FIGURES}, (mine["trainer"], mine, theirs)
    # and so the same summary rows printed
    assert _summary_rows(first) == _summary_rows(local.stdout) and len(_summary_rows(first)) == 2, (
        first, local.stdout)
