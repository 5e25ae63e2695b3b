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

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "tutorials" / "torchrun.md").read_text()
COMMANDS = [line for line in DOC.splitlines() if line.startswith("torchrun ")]


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


@pytest.mark.timeout(150)
def test_single_machine():
    out = subprocess.run(_argv(COMMANDS[0]), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=140)
    assert out.returncode == 0, out.stderr[-3000:]
    _check(out.stdout, trainers=2)


@pytest.mark.timeout(150)
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
            out, err = p.communicate(timeout=140)
            assert p.returncode == 0, err[-3000:]
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    _check("".join(outputs), trainers=3)
