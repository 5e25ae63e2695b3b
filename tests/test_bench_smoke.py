"""`make bench` keeps working: its quick mode runs end to end and writes every figure.
(No timing is asserted here; figures are read from `make bench`, see README.)"""

import json

from tests.benchmarks import bench_remote_module as bench


def test_quick_benchmark_runs(tmp_path, capsys):
    out = tmp_path / "bench.json"
    results = bench.main(["--quick", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["ratios"] == results["ratios"]
    assert set(saved["small_forward_no_grad_s"]) == {
        "raw rpc_sync no-op", "raw RRef call", "torch RemoteModule", "remote_module"
    }
    assert set(saved["round_trip_GB_per_s"]) == {"1MB", "64MB"}
    assert all(v > 0 for v in saved["forward_async_64_calls_per_s"].values())
    printed = capsys.readouterr().out
    assert "ratios of medians" in printed and "memory growth" in printed


def test_verdicts():
    assert bench._verdict("x (target <= 0.70)", 0.69) == "  met"
    assert bench._verdict("x (target <= 0.70)", 0.71) == "  NOT MET"
    assert bench._verdict("x (target >= 1.5)", 6.0) == "  met"
    assert bench._verdict("x (target >= 1.5)", 1.2) == "  NOT MET"
    assert bench._verdict("no target here", 1.0) == ""
