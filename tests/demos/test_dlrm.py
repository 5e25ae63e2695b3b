"""`make demo`'s main job (remote_module/demos/dlrm.py), shortened: the summary's figures are
present and sane, and the command line refuses what it cannot run."""

import itertools
import math

import pytest
import torch

from remote_module.demos import dlrm as dlrm_demo

COLUMNS = ("trainer", "loss first -> last", "AUC", "steps/s", "lookups/s", "pushed B/step", "p50 ms", "p99 ms")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_short_run_learns_and_reports_sane_figures(capfd):
    # 1 server + 2 trainers: DDP among the trainers, the tables' rows over one server
    results = dlrm_demo.main(["--servers", "1", "--trainers", "2", "--steps", "40", "--no-progress", "--plot", ""])
    assert [r["trainer"] for r in results] == ["trainer0", "trainer1"]
    ids_per_step = dlrm_demo.BATCH * dlrm_demo.BAG * len(dlrm_demo.TABLES)
    for r in results:
        assert r["steps"] == 40 and len(r["losses"]) == 40 and r["auc_curve"][-1][0] == 40
        assert r["loss_last"] < r["loss_first"] - 0.05, r
        # the dense features alone cannot get there: the tables learned (0.81 vs 0.73 when written)
        assert r["auc_truth_dense_only"] + 0.03 < r["auc"] <= r["auc_truth"] + 0.02, r
        assert r["steps_per_s"] > 0
        # ids per second spent looking up: at least the ids per second of the whole step
        assert r["lookups_per_s"] >= r["steps_per_s"] * ids_per_step, r
        # only touched rows travel: at most every id's row (id + gradient row) per step
        assert 0 < r["bytes_pushed_per_step"] <= ids_per_step * (8 + 4 * dlrm_demo.DIM), r
        assert 0 < r["lookup_p50_ms"] <= r["lookup_p99_ms"], r
    out = capfd.readouterr().out  # the ranks' lines too (they write to the same stdout)
    _check_progress_lines(out.splitlines(), steps=40)
    header = next(line for line in out.splitlines() if line.startswith("trainer "))
    assert all(c in header for c in COLUMNS), header
    for r in results:
        line = next(line for line in out.splitlines() if line.startswith(r["trainer"] + " "))
        assert f"{r['auc']:.3f}" in line and f"{r['steps_per_s']:.1f}" in line, line
    assert "mode async, 40 steps" in out and "the hidden truth scores" in out


def _check_progress_lines(lines: list[str], steps: int) -> None:
    """Before each slow phase the demo says what it does, in order: the world starting (and
    who has not joined, while ranks import torch), each trainer's DDP group, each table, the
    dense model, training (with a line every few seconds when no bar shows), scoring, the
    shutdown; then the summary. Every line is whole (ranks share stdout)."""
    def index(prefix: str) -> int:
        found = [i for i, line in enumerate(lines) if line.startswith(prefix)]
        assert found, (prefix, lines)
        return found[0]

    world = [index("Starting a local RPC world"), index("  started 3 processes (ps0, trainer0, trainer1)"),
             index("  all 3 ranks joined the RPC world")]
    assert world == sorted(world), lines
    for t in ("trainer0", "trainer1"):
        phases = [f"{t}: forming the trainers' DDP group",
                  *(f"{t}: creating table {name} " for name in dlrm_demo.TABLES),
                  f"{t}: building the dense model", f"{t}: training {steps} steps", f"{t}: {steps} steps done; scoring",
                  f"{t}: finished"]
        at = [index(p) for p in phases]
        assert at == sorted(at) and at[0] > world[1], (phases, lines)
        assert index(f"{t}: finished") < index("  all 3 ranks returned; shutting the RPC world down")
    assert index("  all 3 ranks returned") < index("trainer    loss first -> last")
    for line in lines:  # one process's line never runs into another's
        assert line.count("trainer0:") + line.count("trainer1:") + line.count("ps0:") <= 1, line


def test_auc_is_the_pairwise_rank_statistic():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 6, (60,), generator=gen).float()  # many ties
    labels = torch.bernoulli(torch.full((60,), 0.4), generator=gen)
    pos, neg = scores[labels == 1].tolist(), scores[labels == 0].tolist()
    pairs = [1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg)]
    assert dlrm_demo.auc(scores, labels) == pytest.approx(sum(pairs) / len(pairs))
    assert math.isnan(dlrm_demo.auc(torch.tensor([0.3, 0.1]), torch.tensor([1.0, 1.0])))  # one class only


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--servers", "0"], "argument --servers: must be at least 1, got 0"),
        (["--trainers", "-1"], "argument --trainers: must be at least 1, got -1"),
        (["--steps", "0"], "argument --steps: must be at least 1, got 0"),
        (["--steps", "ten"], "argument --steps: expected a whole number, got 'ten'"),
        (["--mode", "hogwild"], "argument --mode: invalid choice: 'hogwild'"),
        (["--transport", "tcp"], "argument --transport: invalid choice: 'tcp'"),
        (["--mode", "sync", "--overlap"], "--overlap is for --mode async or half_async"),
    ],
)
def test_bad_arguments_are_refused_by_name(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        dlrm_demo.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_transport_is_rpc_backends_default_unless_chosen(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert dlrm_demo.parse_args([]).transport == "uv"
    assert dlrm_demo.parse_args(["--transport", "shm"]).transport == "shm"


def _torchrun_env(monkeypatch, world_size):
    for key, value in {"RANK": "0", "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)


def test_under_torchrun_the_trainers_are_the_other_ranks(monkeypatch):
    _torchrun_env(monkeypatch, 5)
    args = dlrm_demo.parse_args(["--servers", "2"])
    assert args.torchrun and args.trainers == 3


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--servers", "4"], "--servers 4 leaves no trainer among torchrun's 4 processes"),
        (["--servers", "2", "--trainers", "1"], "--trainers 1 does not match torchrun's 4 processes minus --servers 2"),
    ],
)
def test_under_torchrun_impossible_splits_are_refused(argv, message, capsys, monkeypatch):
    _torchrun_env(monkeypatch, 4)
    with pytest.raises(SystemExit):
        dlrm_demo.parse_args(argv)
    assert message in capsys.readouterr().err
