"""`make demo`'s main job (remote_module/demos/dlrm.py), shortened: the summary's figures are
present and sane, and the command line refuses what it cannot run."""

import fcntl
import importlib.util
import itertools
import json
import math
import os
import pty
import re
import struct
import sys
import termios

import pytest
import torch

from remote_module.demos import dlrm as dlrm_demo

COLUMNS = ("trainer", "loss first -> last", "train AUC", "held-out AUC", "steps/s", "lookups/s", "pushed B/step",
           "p50 ms", "p99 ms")


@pytest.mark.slow
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
        # CPU seconds over the training loop: each trainer its own, trainer0 the server's too
        assert set(r["cpu_s"]) == ({"trainer0", "ps0"} if r["trainer"] == "trainer0" else {"trainer1"}), r["cpu_s"]
        assert all(seconds > 0 for seconds in r["cpu_s"].values()), r["cpu_s"]
        # ids per second spent looking up: at least the ids per second of the whole step
        assert r["lookups_per_s"] >= r["steps_per_s"] * ids_per_step, r
        # only touched rows travel: at most every id's row (id + gradient row) per step
        assert 0 < r["bytes_pushed_per_step"] <= ids_per_step * (8 + 4 * dlrm_demo.DIM), r
        # measured at the calls: the pushes travel, and so do the lookups' ids; the answers
        # carry each server's pooled bags, 4 bytes a float, for every table
        assert r["bytes_to_servers_per_step"] > r["bytes_pushed_per_step"], r
        assert r["bytes_from_servers_per_step"] >= dlrm_demo.BATCH * dlrm_demo.DIM * 4 * len(dlrm_demo.TABLES), r
        assert 1 <= r["messages_to_servers_per_step"] < 1.5, r  # one server: one message a step (+ the first lookup)
        assert 0 < r["lookup_p50_ms"] <= r["lookup_p99_ms"], r
    out = capfd.readouterr().out  # the ranks' lines too (they write to the same stdout)
    _check_progress_lines(out.splitlines(), steps=40)
    header = next(line for line in out.splitlines() if line.startswith("trainer "))
    assert all(c in header for c in COLUMNS), header
    for r in results:
        line = next(line for line in out.splitlines() if line.startswith(r["trainer"] + " "))
        assert line.split()[4:6] == [f"{r['auc_train']:.3f}", f"{r['auc']:.3f}"], line
        assert f"{r['steps_per_s']:.1f}" in line, line
        assert r["auc_train"] == r["auc_curve"][-1][1]
    assert "1 parameter server, 2 trainers, mode async, 40 steps" in out and "the hidden truth scores" in out
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("network between trainers and servers"))
    assert "RPC payload" in lines[at] and "not counted: TensorPipe's framing, TCP/IP headers" in lines[at], lines[at]
    assert lines[at + 1].split()[:4] == ["trainer", "to", "servers", "B"], lines[at + 1]
    for k, r in enumerate(results, at + 2):
        assert lines[k].split()[:3] == [r["trainer"], f"{r['bytes_to_servers_per_step']:,.0f}",
                                        f"{r['bytes_from_servers_per_step']:,.0f}"], lines[k]
    assert all(line.startswith("  ") for line in lines[at + 1:at + 3 + len(results)])  # (not the main table's rows)
    total = lines[at + 2 + len(results)].split()
    assert total[:2] == ["all", "trainers"], total
    assert float(total[2].replace(",", "")) == pytest.approx(sum(r["bytes_to_servers_per_step"] for r in results),
                                                             abs=1), total
    assert "train AUC: of the last 20 training batches" in out and "held-out AUC: on 4096 held-out clicks" in out
    assert "(71.0 MB of weights)" in out  # eager tables
    # a plain run samples no table_stats() and keeps eager tables
    assert all("rows" not in r and "distinct_ids" not in r for r in results)
    assert "rows held per server" not in out and "(lazy)" not in out


@pytest.mark.slow
def test_stream_with_admission_and_eviction_holds_a_bounded_number_of_rows(capfd, tmp_path):
    # 2 servers + 1 trainer: one trainer's async pushes step the tables once per training step
    png = tmp_path / "demo.png"
    results = dlrm_demo.main(["--servers", "2", "--trainers", "1", "--steps", "30", "--stream", "--admit-after", "2",
                              "--evict-after-steps", "6", "--no-progress", "--plot", str(png)])
    (r,) = results
    assert r["auc_truth_dense_only"] < r["auc"], r  # the tables still learn the popular head
    rows, curve = r["rows"], r["rows_held_curve"]
    assert list(rows) == ["ps0", "ps1"], rows
    assert r["stats_every"] == 1 and [step for step, _ in curve] == list(range(1, 31)), curve
    bytes_held = sum(f["bytes"] for f in rows.values())
    totals = [sum(held.values()) for _, held in curve]
    for server, f in rows.items():
        assert f["steps"] == 30, f
        assert f["held_first"] == 0, f  # after one step no id was looked up in 2 steps yet
        assert 0 < f["held_last"] <= f["held_max"] <= f["admitted"], f
        assert f["evicted"] > 0, f
    # the drifting ids' rows are dropped once unused: the servers hold far fewer rows than the
    # distinct ids drawn (about a fifth when written), and no more at the end than midway on
    assert 0 < totals[-1] <= r["distinct_ids"] / 2, (totals, r["distinct_ids"])
    assert max(totals) <= r["distinct_ids"] / 2, (totals, r["distinct_ids"])
    assert totals[-1] <= 1.5 * totals[len(totals) // 2], totals
    out = capfd.readouterr().out
    lines = out.splitlines()
    assert "ids: --stream:" in out and "evicted after 6 of its table's steps unstepped" in out, out
    # lazy tables are shown with what they held, not with an eager table's size; one trainer
    tables = next(line for line in lines if line.startswith("tables: "))
    assert (f"(lazy: rows created as admitted; at the end the servers held {bytes_held / 1e6:.2f} MB: rows, "
            "their optimizer state and bookkeeping; eager, their weights alone would take 71.0 MB)") in tables, tables
    assert "2 parameter servers, 1 trainer, mode async" in out and "(1 trainer)" in out, out
    assert "(s)" not in out and "1 trainers" not in out, out
    at = next(i for i, line in enumerate(lines) if line.startswith("rows held per server, all 3 tables"))
    # the table counts the tables' steps on the servers, and says so beside the PNG's axis
    assert "every 1 training step, from step 1 to 30 as on the PNG's step axis" in lines[at], lines[at]
    assert lines[at + 1].split()[:5] == ["server", "table", "steps", "held", "first"], lines[at + 1]
    for k, (server, f) in enumerate(rows.items(), at + 2):
        assert lines[k].split()[:6] == [server, "30", f"{f['held_first']:,}", f"{f['held_last']:,}",
                                        f"{f['held_max']:,}", f"{f['admitted']:,}"], lines[k]
    assert lines[at + 4].startswith("total") and f"{totals[-1]:,}" in lines[at + 4], lines[at + 4]
    assert f"trainer0 {r['distinct_ids']:,}" in lines[at + 5], lines[at + 5]
    if importlib.util.find_spec("matplotlib") is None:  # (the `plot` extra; `make test` leaves it out)
        assert "install matplotlib" in out
    else:
        assert f"loss and AUC curves, rows held per server: {png}" in out
        assert png.read_bytes().startswith(b"\x89PNG"), png


@pytest.mark.slow
def test_geo_reports_the_rows_its_deltas_push_and_how_geo_sends(capfd, tmp_path):
    # geo pushes row deltas every GEO_PUSH_EVERY steps and at the end (25 steps: two pushes),
    # not a step's gradients with the next lookups: the per-server figures count those rows
    figures = tmp_path / "figures.json"
    results = dlrm_demo.main(["--mode", "geo", "--servers", "2", "--trainers", "1", "--steps", "25", "--no-progress",
                              "--plot", "", "--json", str(figures)])
    (r,) = results
    # --json: the figures main returns, every float at full precision (tuples become lists)
    assert json.loads(figures.read_text()) == json.loads(json.dumps(results))
    assert len(json.loads(figures.read_text())[0]["losses"]) == 25
    assert set(r["per_server"]) == {"ps0", "ps1"}
    for server, t in r["per_server"].items():
        assert t["rows_pushed_per_s"] > 0, (server, t)
    out = capfd.readouterr().out
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("per server ("))
    assert "geo: a trainer trains its cached rows itself" in lines[at], lines[at]
    assert f"every {dlrm_demo.GEO_PUSH_EVERY} steps (and at the end) the deltas" in lines[at], lines[at]
    assert "a step sends its pushes and the next batch's lookups together" not in out, out
    for k, (server, t) in enumerate(r["per_server"].items(), at + 2):
        assert lines[k].split()[0] == server and lines[k].split()[-1] == f"{t['rows_pushed_per_s']:,.0f}", lines[k]
    assert "pushed B/step: bytes of row deltas" in out, out
    assert f"every trainer's figures (each step's loss, the AUC curves): {figures}" in out, out


def test_stream_ids_drift_and_keep_a_popular_head():
    truth = dlrm_demo.Truth()
    gen = torch.Generator().manual_seed(0)
    drift = dlrm_demo.STREAM_WINDOW // dlrm_demo.STREAM_DRIFT  # steps an id stays in the window
    for k, rows in enumerate(dlrm_demo.TABLES.values()):
        head = set(truth.ids_by_rank[k][:dlrm_demo.STREAM_HEAD].tolist())
        early, late = ({*truth.batch(gen, 2048, step=step).ids[k].flatten().tolist()} for step in (0, drift))
        # the head is drawn throughout; the window's ids then are all gone a window's slide later
        assert len(head & early) > dlrm_demo.STREAM_HEAD // 2 and len(head & late) > dlrm_demo.STREAM_HEAD // 2
        assert not (early - head) & (late - head), rows
        window = {*truth.ids_by_rank[k][dlrm_demo.STREAM_HEAD:dlrm_demo.STREAM_HEAD + dlrm_demo.STREAM_WINDOW].tolist()}
        assert early - head <= window
    # a plain batch draws as before the stream existed (the same generator calls)
    a, b = truth.batch(torch.Generator().manual_seed(1)), truth.batch(torch.Generator().manual_seed(1), step=None)
    assert all(torch.equal(x, y) for x, y in zip(a.ids, b.ids))


def test_the_png_gets_a_rows_held_panel_when_rows_were_sampled(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    saved = []
    real_savefig = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, *a, **k: (saved.append(fig), real_savefig(fig, *a, **k))[1])
    result = {"trainer": "trainer0", "losses": [0.7, 0.6], "auc_curve": [(2, 0.6)], "auc": 0.6, "auc_truth": 0.8,
              "auc_truth_dense_only": 0.7, "rows_held_curve": [(1, {"ps0": 0, "ps1": 0}), (2, {"ps0": 5, "ps1": 7})]}
    args = dlrm_demo.parse_args(["--mode", "sync", "--servers", "2", "--trainers", "1", "--steps", "2"])
    title = dlrm_demo.run_title(args, 1)
    assert title == "DLRM click model: 2 parameter servers, 1 trainer, mode sync, 2 steps of 128 clicks per trainer"
    assert dlrm_demo.plot([result], str(tmp_path / "rows.png"), title) == str(tmp_path / "rows.png")
    import matplotlib.image

    height, width = matplotlib.image.imread(tmp_path / "rows.png").shape[:2]
    assert width > 3 * height  # three panels side by side: 15 x 3.8 inches (two: 10 x 3.8)
    # titled with the run, every panel over the same steps: the training steps
    (fig,) = saved
    assert fig._suptitle is not None and fig._suptitle.get_text() == title
    assert [ax.get_xlabel() for ax in fig.axes] == ["training step"] * 3


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
    # the setup, the same on every trainer, is told once (by trainer0)
    setup = ["forming the trainers' DDP group (2 trainers)", "building the dense model",
             *(f"creating table {name} " for name in dlrm_demo.TABLES), f"training {steps} steps"]
    at = [index(p) for p in setup]
    assert at == sorted(at) and at[0] > world[1], (setup, lines)
    for phase in setup:
        assert sum(line.startswith(phase) and "(still, " not in line for line in lines) == 1, (phase, lines)
    for t in ("trainer0", "trainer1"):
        phases = [f"{t}: {steps} steps done; scoring", f"{t}: finished"]
        mine = [index(p) for p in phases]
        assert mine == sorted(mine) and mine[0] > at[-1], (phases, lines)
        assert index(f"{t}: finished") < index("  all 3 ranks returned; shutting the RPC world down")
    assert index("  all 3 ranks returned") < index("trainer    loss first -> last")
    assert not any(line.startswith(("trainer0: forming", "trainer1: forming", "trainer1: creating")) for line in lines)
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
        (["--evict-after-steps", "0"], "argument --evict-after-steps: must be at least 1, got 0"),
        (["--admit-after", "256"], "argument --admit-after: must be at most 255, got 256"),
        (["--mode", "geo", "--admit-after", "2"], "--admit-after and --evict-after-steps are for --mode sync, async"),
        (["--mode", "geo", "--evict-after-steps", "9"], "--admit-after and --evict-after-steps are for --mode sync"),
        (["--every", "5"], "--every is the steps between checkpoints: pass --checkpoint DIR too"),
        (["--mode", "geo", "--checkpoint", "d"], "--checkpoint is for --mode sync, async or half_async"),
        (["--checkpoint", "d", "--every", "0"], "argument --every: must be at least 1, got 0"),
        (["--full-every", "3"], "--full-every is how often a checkpoint is saved whole: pass --checkpoint DIR too"),
        (["--checkpoint", "d", "--full-every", "0"], "argument --full-every: must be at least 1, got 0"),
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


def _screen(raw: str) -> list[str]:
    """What a terminal shows after ``raw``: text, carriage returns, newlines, cursor up."""
    screen: list[list[str]] = [[]]
    row = col = 0
    at = 0
    while at < len(raw):
        escape = re.match(r"\x1b\[(\d*)([A-Za-z])", raw[at:])
        if escape:
            if escape.group(2) == "A":
                row = max(0, row - int(escape.group(1) or 1))
            elif escape.group(2) == "K":
                del screen[row][col:]
            at += escape.end()
            continue
        char, at = raw[at], at + 1
        if char == "\r":
            col = 0
        elif char == "\n":
            row += 1
            screen.extend([] for _ in range(row + 1 - len(screen)))
        else:
            line = screen[row]
            line.extend(" " * (col - len(line)))
            line[col:col + 1] = [char]
            col += 1
    return ["".join(line).rstrip() for line in screen]


@pytest.mark.slow
def test_on_a_terminal_the_setup_lines_and_the_bars_do_not_clobber_each_other():
    # the trainers share the terminal: the setup is told once, then one bar per trainer, each
    # on its own line (no half-drawn first frame left behind, no line overwritten)
    pytest.importorskip("tqdm")
    pid, fd = pty.fork()
    if pid == 0:  # the child: a 120 x 40 terminal, the demo on it
        fcntl.ioctl(1, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        os.execv(sys.executable, [sys.executable, "-m", "remote_module.demos.dlrm", "--servers", "1", "--trainers",
                                  "2", "--steps", "20", "--plot", ""])
    raw = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        raw += chunk
    _, status = os.waitpid(pid, 0)
    screen = _screen(raw.decode("utf-8", "replace"))
    assert os.waitstatus_to_exitcode(status) == 0, screen
    start = next(i for i, line in enumerate(screen) if line.startswith("training 20 steps"))
    bars = screen[start + 1:start + 3]
    assert [line.split("|")[0].split() for line in bars] == [["trainer0:", "100%"], ["trainer1:", "100%"]], screen
    assert not any(" 0%|" in line for line in screen), screen  # a first frame left behind
    assert sum(line.startswith("creating table user") and "(still, " not in line for line in screen) == 1, screen
