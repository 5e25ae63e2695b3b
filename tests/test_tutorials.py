"""Every tutorial runs as its docstring says."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_quickstart():
    out = subprocess.run(
        [sys.executable, "tutorials/quickstart.py"], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[(128, 30), (4, 30), 2]"


def test_hybrid_ddp_loss_goes_down():
    out = subprocess.run(
        [sys.executable, "tutorials/hybrid_ddp.py", "--steps", "100"], cwd=ROOT, capture_output=True, text=True,
        timeout=170, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("trainer")]
    assert len(lines) == 2
    for line in lines:
        first, last = (float(v) for v in line.split("loss ")[1].split(" -> "))
        assert last < 0.8 * first, line


@pytest.mark.slow
def test_pipeline_trains_and_loss_goes_down():
    out = subprocess.run(
        [sys.executable, "tutorials/pipeline.py", "--steps", "8"], cwd=ROOT, capture_output=True, text=True,
        timeout=170, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == [f"step {i}" for i in range(8)], out.stdout
    losses = [float(line.split("loss ")[1]) for line in lines]
    assert losses[-1] < 0.9 * losses[0], losses
    assert "on=worker1" in out.stdout and "on=worker2" in out.stdout, out.stdout  # two stages, two hosts


@pytest.mark.slow
def test_sharded_seed_example_and_megatron_step():
    out = subprocess.run(
        [sys.executable, "-m", "tutorials.sharded"], cwd=ROOT, capture_output=True, text=True,
        timeout=170, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "local results: [1.5, 6.0]" in lines, out.stdout
    assert "full_tensor(): 7.5" in lines, out.stdout
    mlp = [line for line in lines if line.startswith("Megatron MLP step:")]
    assert len(mlp) == 1, out.stdout
    assert float(mlp[0].rsplit(": ", 1)[1]) < 1e-5, mlp[0]  # equal to the local model after the SGD step


# tutorials/parameter_server.py is run by tests/test_torchrun.py, under torchrun and under
# run_local (one launch each); its modes are tested in tests/test_ps.py.
