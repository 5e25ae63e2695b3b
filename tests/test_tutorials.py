"""Every tutorial runs as its docstring says, both as `python tutorials/<name>.py` and as
`python -m tutorials.<name>`, without torch's avoidable warnings."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests._avoidable import no_avoidable_warnings
from tests._deadlines import HANG_S, SETUP_S

ROOT = Path(__file__).resolve().parent.parent
#: a hang guard for one tutorial run: starting its world (SETUP_S), then its short job
RUN_S = SETUP_S + HANG_S


def test_quickstart():
    out = subprocess.run(
        [sys.executable, "tutorials/quickstart.py"], cwd=ROOT, capture_output=True, text=True, timeout=RUN_S,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[(128, 30), (4, 30), 2]"


def test_hybrid_ddp_loss_goes_down():
    out = subprocess.run(
        [sys.executable, "tutorials/hybrid_ddp.py", "--steps", "100"], cwd=ROOT, capture_output=True, text=True,
        timeout=RUN_S, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if re.match(r"trainer\d: loss ", line)]
    assert len(lines) == 2, out.stdout
    # it says what it does while it runs: the world starting, each trainer's phases, in order
    said = out.stdout.splitlines()
    for t in ("trainer0", "trainer1"):
        phases = [f"{t}: joining the trainers' DDP group", f"{t}: training 100 steps", f"{t}: loss "]
        at = [next(i for i, line in enumerate(said) if line.startswith(p)) for p in phases]
        assert at == sorted(at), out.stdout
    assert said[0].startswith("Starting 3 local processes"), out.stdout
    assert any(line.startswith("  all 3 ranks joined the RPC world") for line in said), out.stdout
    for line in lines:
        first, last = (float(v) for v in line.split("loss ")[1].split(" -> "))
        assert last < 0.8 * first, line


@pytest.mark.slow
def test_pipeline_trains_and_loss_goes_down():
    out = subprocess.run(
        [sys.executable, "tutorials/pipeline.py", "--steps", "8"], cwd=ROOT, capture_output=True, text=True,
        timeout=RUN_S, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == [f"step {i}" for i in range(8)], out.stdout
    losses = [float(line.split("loss ")[1]) for line in lines]
    assert losses[-1] < 0.9 * losses[0], losses
    assert "on=worker1" in out.stdout and "on=worker2" in out.stdout, out.stdout  # two stages, two hosts
    _says_the_world_starting(out.stdout, 3)
    no_avoidable_warnings(out.stderr)


@pytest.mark.slow
def test_sharded_seed_example_and_megatron_step():
    out = subprocess.run(
        [sys.executable, "-m", "tutorials.sharded"], cwd=ROOT, capture_output=True, text=True,
        timeout=RUN_S, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "local results: [1.5, 6.0]" in lines, out.stdout
    assert "full_tensor(): 7.5" in lines, out.stdout
    mlp = [line for line in lines if line.startswith("Megatron MLP step:")]
    assert len(mlp) == 1, out.stdout
    assert float(mlp[0].rsplit(": ", 1)[1]) < 1e-5, mlp[0]  # equal to the local model after the SGD step
    _says_the_world_starting(out.stdout, 3)


@pytest.mark.slow
def test_embeddings_table_trains_and_its_checkpoint_loads_locally():
    out = subprocess.run(
        [sys.executable, "tutorials/embeddings.py", "--steps", "100"], cwd=ROOT, capture_output=True, text=True,
        timeout=RUN_S, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    loss = [line for line in lines if line.startswith("trainer0: loss ")]
    assert len(loss) == 1, out.stdout
    first, last = (float(v) for v in loss[0].split("loss ")[1].split(" -> "))
    assert last < 0.5 * first, loss[0]
    pushed = [line for line in lines if line.startswith("pushed per step: ")]
    assert len(pushed) == 1, out.stdout
    per_step, table = (float(v) for v in re.findall(r"([\d.]+) KiB", pushed[0]))
    assert 0 < per_step < table, pushed[0]  # only the touched rows' gradients travel
    check = [line for line in lines if line.startswith("checkpoint in nn.EmbeddingBag: max difference ")]
    assert len(check) == 1 and float(check[0].rsplit(" ", 1)[1]) < 1e-5, out.stdout  # float32 rounding at most
    # the server saved its own rows: a fresh table loads them, and dcp.load reads them, bit for bit
    assert "loaded equal True, dcp.load equal True" in out.stdout, out.stdout
    no_avoidable_warnings(out.stderr)
    # it says how it goes while it runs: the world starting, then a line every quarter of the steps
    _says_the_world_starting(out.stdout, 2)
    steps = [line.split(",")[0] for line in lines if line.startswith("trainer0: step ")]
    assert steps == [f"trainer0: step {k}/100" for k in (25, 50, 75, 100)], out.stdout
    assert lines.index(loss[0]) > max(i for i, line in enumerate(lines) if line.startswith("trainer0: step "))


@pytest.mark.slow
def test_serving_batches_and_survives_a_killed_replica():
    out = subprocess.run(
        [sys.executable, "tutorials/serving.py"], cwd=ROOT, capture_output=True, text=True,
        timeout=RUN_S, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    batching = [line for line in lines if line.startswith("batching: 48 calls from 3 clients, ")]
    assert len(batching) == 1, out.stdout
    forwards = int(re.search(r"(\d+) forwards on server0", batching[0]).group(1))
    assert 1 <= forwards < 48, batching[0]  # calls that arrived together ran as one forward
    assert float(batching[0].rsplit(": ", 1)[1]) < 1e-5, batching[0]
    assert "failover: 60 calls, 0 failed" in lines, out.stdout
    assert any(line.startswith("  server2: lost (") for line in lines), out.stdout
    assert "  server0: live" in lines and "  server1: live" in lines, out.stdout
    # (stderr has torch's own messages of the killed peer's connections: not checked here)
    _says_the_world_starting(out.stdout, 6)


def _says_the_world_starting(stdout: str, ranks: int) -> None:
    """A tutorial's first lines: what it starts, then run_local's progress, before any result."""
    lines = stdout.splitlines()
    assert lines[0].startswith(f"Starting {ranks} local processes"), stdout
    joined = next(i for i, line in enumerate(lines) if line.startswith(f"  all {ranks} ranks joined the RPC world"))
    # (a rank may print before the launcher sees that all joined: the ranks' own lines can
    # come before that line, so only the launcher's lines are checked in order)
    returned = [i for i, line in enumerate(lines) if line.startswith(f"  all {ranks} ranks returned")]
    assert all(joined < i for i in returned), stdout


# tutorials/parameter_server.py is run by tests/test_torchrun.py in both forms: as a script
# under torchrun and as a module under run_local; its modes are tested in tests/ps/test_dense.py.


@pytest.mark.slow
def test_parameter_server_resumes_from_its_checkpoint(tmp_path):
    # parameter-servers.md's two commands, shortened: the second run resumes where the first ended
    def run(steps: int) -> str:
        out = subprocess.run([sys.executable, "tutorials/parameter_server.py", "--steps", str(steps), "--checkpoint",
                              str(tmp_path), "--every", "2"], cwd=ROOT, capture_output=True, text=True, timeout=RUN_S,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout

    first = run(4)
    assert "resumed" not in first and "trainer0: mode sync, 4 steps" in first, first
    again = run(6)
    for trainer in ("trainer0", "trainer1"):
        assert f"{trainer}: resumed from step 4" in again and f"{trainer}: mode sync, 2 steps" in again, again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004", "step-00000006"]


#: each tutorial in the launch form the tests above do not use, with the cheapest arguments
OTHER_FORM = [
    ("quickstart", "module", []),
    ("sharded", "script", []),
    ("pipeline", "module", ["--steps", "2"]),
    ("hybrid_ddp", "module", ["--steps", "3"]),
    ("embeddings", "module", ["--steps", "5"]),
    ("serving", "module", []),
]


def test_every_tutorial_script_is_run_in_both_forms():
    scripts = {path.stem for path in (ROOT / "tutorials").glob("*.py")} - {"torchrun_job"}  # torchrun only
    # parameter_server: both forms in tests/test_torchrun.py
    assert {name for name, _, _ in OTHER_FORM} | {"parameter_server"} == scripts


@pytest.mark.slow
@pytest.mark.parametrize("name, form, extra", OTHER_FORM, ids=[f"{n}-{f}" for n, f, _ in OTHER_FORM])
def test_tutorial_runs_in_its_other_launch_form(name, form, extra):
    # as a user runs it: from the checkout, with the project installed, no PYTHONPATH
    head = ["tutorials/" + name + ".py"] if form == "script" else ["-m", "tutorials." + name]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, *head, *extra], cwd=ROOT, capture_output=True, text=True,
                         timeout=RUN_S, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    no_avoidable_warnings(out.stderr)
