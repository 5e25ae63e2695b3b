"""The torchrun walkthrough in tutorials/torchrun.md, run with its own commands."""

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rpc_backend import loopback_env
from tests._avoidable import no_avoidable_warnings
from tests._deadlines import HANG_S, SETUP_S

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "tutorials" / "torchrun.md").read_text()
COMMANDS = [line for line in DOC.splitlines() if line.startswith("torchrun ") and "torchrun_job.py" in line]
PS_COMMANDS = [line for line in DOC.splitlines() if line.startswith("torchrun ") and "parameter_server.py" in line]
#: a hang guard for one torchrun job: starting its world (SETUP_S), then its short run
JOB_S = SETUP_S + HANG_S
DLRM_COMMANDS = [
    line for line in DOC.splitlines() if line.startswith("torchrun ") and "remote_module.demos.dlrm" in line
]


def _argv(command: str, **subs: str) -> list[str]:
    for key, value in subs.items():
        command = command.replace(key, value)
    words = shlex.split(command)
    launcher = shutil.which("torchrun")
    head = [launcher] if launcher else [sys.executable, "-m", "torch.distributed.run"]
    return head + words[1:]


def _env() -> dict:
    return {**os.environ, **loopback_env(), "PYTHONPATH": str(ROOT)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check(output: str, trainers: int) -> None:
    for t in range(trainers):
        match = re.search(rf"trainer{t}: loss ([\d.]+) -> ([\d.]+)", output)
        assert match, output[-3000:]
        assert float(match.group(2)) < float(match.group(1))
    assert f"ps0: serving {trainers} trainers" in output


def test_doc_has_the_commands():
    assert len(COMMANDS) == 3
    assert PS_COMMANDS == ["torchrun --standalone --nproc-per-node=4 tutorials/parameter_server.py --mode sync"]
    assert DLRM_COMMANDS == [
        "torchrun --standalone --nproc-per-node=4 -m remote_module.demos.dlrm --servers 2",
        "torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST0:PORT "
        "-m remote_module.demos.dlrm --servers 2",
        # the servers on a machine of their own (run on 3 simulated machines by tests/test_machines_demo.py)
        *(f"torchrun --nnodes=3 --nproc-per-node={n} --node-rank={r} --master-addr=HOST0 --master-port=PORT "
          "-m remote_module.demos.dlrm --servers 2" for r, n in ((0, 2), (1, 1), (2, 1))),
    ]


def test_single_machine():
    out = subprocess.run(_argv(COMMANDS[0]), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=JOB_S)
    assert out.returncode == 0, out.stderr[-3000:]
    _check(out.stdout, trainers=2)
    # init_from_env keeps gloo's per-rank "Backend ... as a ProcessGroup" off the console, and
    # the workers drop TorchScript's functional optimizer deprecation (DistributedOptimizer)
    no_avoidable_warnings(out.stderr)


def test_two_machines_on_loopback():
    port = str(_free_port())
    procs = [
        subprocess.Popen(_argv(cmd, HOST0="127.0.0.1", PORT=port), cwd=ROOT, env=_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for cmd in COMMANDS[1:]
    ]
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=JOB_S)
            assert p.returncode == 0, err[-3000:]
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    _check("".join(outputs), trainers=3)


def _trainer_lines(output: str) -> list[str]:
    return sorted(line for line in output.splitlines() if re.match(r"trainer\d: mode ", line))


@pytest.mark.slow
def test_parameter_server_job_under_torchrun_and_run_local():
    # the documented command: 4 ranks, roles {"ps": 2, "trainer": 2}, sync mode
    out = subprocess.run(_argv(PS_COMMANDS[0]), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=JOB_S)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ps0: serving 2 trainers" in out.stdout and "ps1: serving 2 trainers" in out.stdout, out.stdout
    lines = _trainer_lines(out.stdout)
    assert [line.split(":")[0] for line in lines] == ["trainer0", "trainer1"], out.stdout
    for line in lines:
        first, last = (float(v) for v in line.split("loss ")[1].split(" -> "))
        assert last < 0.5 * first, line
    # the same tutorial, unchanged, started by run_local in its other launch form (as a module,
    # with the project installed and no PYTHONPATH, as tests/test_tutorials.py runs the others):
    # sync mode is deterministic (pushes are summed in trainer-name order), so both launchers
    # print the same losses
    env = {k: v for k, v in _env().items() if k != "PYTHONPATH"}
    local = subprocess.run([sys.executable, "-m", "tutorials.parameter_server", "--mode", "sync"], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=JOB_S)
    assert local.returncode == 0, local.stderr[-3000:]
    assert _trainer_lines(local.stdout) == lines, (local.stdout, out.stdout)
    no_avoidable_warnings(local.stderr)


@pytest.mark.slow
def test_dlrm_demo_under_torchrun_prints_one_summary(tmp_path):
    # the documented one-machine command (2 servers + 2 trainers), shortened
    png = tmp_path / "curves.png"
    command = f"{DLRM_COMMANDS[0]} --steps 20 --plot {png}"
    out = subprocess.run(_argv(command), cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=JOB_S)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    # trainer0 gathered every trainer's figures: one header, one line per trainer, nothing from the servers
    assert sum(line.startswith("DLRM click model: 2 parameter servers, 2 trainers") for line in lines) == 1, (
        out.stdout
    )
    assert sum(line.startswith("trainer    loss first -> last") for line in lines) == 1, out.stdout
    rows = [line.split() for line in lines if re.match(r"trainer\d ", line)]
    assert [row[0] for row in rows] == ["trainer0", "trainer1"], out.stdout
    for row in rows:
        first, last, held_out_auc, steps_per_s = float(row[1]), float(row[3]), float(row[5]), float(row[6])
        assert last < first and held_out_auc > 0.6 and steps_per_s > 0, row
    assert not any(line.startswith(("ps0:", "ps1:")) for line in lines), out.stdout  # nothing from the servers
    # the per-server table (trainer0's traffic): one message per server per step (the pushes and
    # the next batch's lookups together), and one line per server
    served = [line.split() for line in lines if re.match(r"ps\d +\d", line)]
    assert [row[0] for row in served] == ["ps0", "ps1"], out.stdout
    assert all(float(row[1]) <= 1.1 for row in served), out.stdout
    # one PNG, from trainer0 (or, without matplotlib, one hint instead)
    if png.exists():
        assert [p.name for p in tmp_path.iterdir()] == ["curves.png"]
        assert out.stdout.count("loss and AUC curves:") == 1
    else:
        assert out.stdout.count("install matplotlib") == 1, out.stdout
