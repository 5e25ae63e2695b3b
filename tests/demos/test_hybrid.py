"""`make demo-hybrid`'s job (the first demo), shortened; `make demo` is tests/demos/test_dlrm.py."""

from remote_module.demos import hybrid as demo


def test_demo_trains_the_hybrid_model(capsys):
    summary = demo.main(["--steps", "150", "--no-progress"])
    assert summary["steps"] == 150
    assert summary["loss_after"] < 0.8 * summary["loss_before"]
    assert summary["steps_per_s"] > 0
    out = capsys.readouterr().out
    assert "loss before" in out and "loss after" in out and "steps/s" in out


def test_off_a_terminal_the_progress_is_plain_lines(capfd):
    # `make demo-hybrid | tee log`: no bar frames (carriage returns piling up on one line), a
    # plain line every tenth of the run instead
    demo.main(["--steps", "20"])
    out, err = capfd.readouterr()
    assert "\r" not in out + err, (out + err)[-2000:]
    lines = [line for line in out.splitlines() if line.startswith("hybrid training: step ")]
    assert [line.split(",")[0] for line in lines] == [f"hybrid training: step {k}/20" for k in range(2, 21, 2)], out
