"""`make demo-hybrid`'s job (the first demo), shortened; `make demo` is tests/demos/test_dlrm.py."""

from remote_module.demos import hybrid as demo


def test_demo_trains_the_hybrid_model(capsys):
    summary = demo.main(["--steps", "150", "--no-progress"])
    assert summary["steps"] == 150
    assert summary["loss_after"] < 0.8 * summary["loss_before"]
    assert summary["steps_per_s"] > 0
    out = capsys.readouterr().out
    assert "loss before" in out and "loss after" in out and "steps/s" in out
