"""DC-ASGD (issue 26): ``PSModel(..., ps_mode="async", dc_asgd=lambda_)`` applies ``g + lambda_ *
g * g * (w_now - w_sent)`` on the servers, ``w_sent`` what a server last sent that trainer."""

from __future__ import annotations

import re
from fractions import Fraction

import numpy as np
import pytest
import torch
from torch import nn

from remote_module.ps import PSModel
from tests.ps import _dc_asgd_remote as r
from tests.ps._world import job


@pytest.fixture
def world(ps_world):  # shared with the other PS tests (tests/conftest.py)
    return ps_world


def interleaved(world, name: str, build, backward, between: str | None = None) -> dict:  # noqa: ANN001
    """The fixed interleaving of two trainers the formula tests use: both build (``build``: the
    remote builder and its arguments), trainer1 computes its gradient at w0 (``backward``),
    trainer0 computes its own and steps (w0 -> w1), trainer1 does ``between`` (a read, see
    ``r.between``) and steps (w1 -> w2). The values and each trainer's backward."""
    w0 = world.run({"trainer0": build, "trainer1": build})["trainer0"]
    late = world.run({"trainer1": (backward, name, 1, 0)})["trainer1"]  # at w0, pushed later
    first = world.run({"trainer0": (backward, name, 0, 0)})["trainer0"]
    world.run({"trainer0": (r.step, name)})
    w1 = world.run({"trainer0": (r.values, name)})["trainer0"]
    if between is not None:
        world.run({"trainer1": (r.between, name, between)})
    world.run({"trainer1": (r.step, name)})
    # (read by trainer1: its pull waits for its own push in flight, which trainer0's would not)
    w2 = world.run({"trainer1": (r.values, name)})["trainer1"]
    return {"w0": w0, "w1": w1, "w2": w2, "late": late, "first": first}


@pytest.mark.parametrize("lam", [0.0, 0.5])
def test_the_applied_update_is_the_formula_for_two_trainers_in_a_fixed_order(world, lam):
    """trainer1 computes its gradient at w0; trainer0 steps (w0 -> w1); then trainer1's push is
    compensated with w_now - w_sent = w1 - w0. SGD, so each update is exact to float32."""
    name, lr = job("dc"), 0.3
    got = interleaved(world, name, (r.build, name, lam, lr), r.backward)
    w0, w1, w2, late, first = got["w0"], got["w1"], got["w2"], got["late"], got["first"]
    for k in w0:
        assert torch.equal(late["used"][k], w0[k]) and torch.equal(first["used"][k], w0[k])
        # trainer0's push: sent w0, w_now w0: no compensation
        torch.testing.assert_close(w1[k], w0[k] - lr * first["grads"][k], rtol=0, atol=1e-6)
        g = late["grads"][k]
        compensated = g + lam * g * g * (w1[k] - w0[k])
        torch.testing.assert_close(w2[k], w1[k] - lr * compensated, rtol=0, atol=1e-6)
    if lam:  # the compensation changed the update (else this test would not tell)
        plain = {k: w1[k] - lr * late["grads"][k] for k in w0}
        assert max(float((w2[k] - plain[k]).abs().max()) for k in w0) > 1e-5


@pytest.mark.parametrize("what", ["state_dict", "pull", "eval", "optimizer_state_dict"])
def test_a_read_between_backward_and_step_keeps_w_sent_the_values_the_gradient_was_computed_at(world, what):
    """Found by the DC-ASGD hostile review: trainer1's gradient is computed at w0, trainer0 then
    steps (w0 -> w1), and trainer1 takes a checkpoint (state_dict()), pulls, or evaluates under
    no_grad before its step. Its gradient is still w0's, so its push is compensated with w1 -
    w0 (before, those reads reset w_sent to w1: no compensation at all)."""
    name, lam, lr = job("dc-read"), 0.5, 0.3
    got = interleaved(world, name, (r.build, name, lam, lr), r.backward, between=what)
    w0, w1, w2, late = got["w0"], got["w1"], got["w2"], got["late"]
    for k in w0:
        g = late["grads"][k]
        torch.testing.assert_close(w2[k], w1[k] - lr * (g + lam * g * g * (w1[k] - w0[k])), rtol=0, atol=1e-6)


@pytest.mark.parametrize("who", ["the loading trainer", "another trainer"])
def test_a_gradient_from_before_a_load_is_applied_to_the_loaded_values_as_torch_does(world, who):
    """Found by the DC-ASGD hostile review: a trainer's gradient is computed at w0, then a
    trainer loads a checkpoint w_L (load_state_dict), then the first trainer steps. As torch's
    optimizer after a load, the step applies g to w_L (a load is no other trainer's update to
    compensate); before, w_sent stayed w0, and the push was "compensated" by
    lambda * g * g * (w_L - w0), however far the checkpoint was."""
    name, lam, lr = job("dc-load"), 0.5, 0.3
    built = world.run({"trainer0": (r.build, name, lam, lr), "trainer1": (r.build, name, lam, lr)})
    w0 = built["trainer0"]
    loaded = {k: v + 1.0 for k, v in w0.items()}
    steps = "trainer0" if who == "the loading trainer" else "trainer1"
    got = world.run({steps: (r.backward, name, 1, 0)})[steps]
    world.run({"trainer0": (r.load, name, loaded)})
    world.run({steps: (r.step, name)})
    after = world.run({steps: (r.values, name)})[steps]  # (its pull waits for its push in flight)
    for k in w0:
        torch.testing.assert_close(after[k], loaded[k] - lr * got["grads"][k], rtol=0, atol=1e-6)


def test_a_half_precision_gradient_whose_square_overflows_is_applied_when_nothing_changed(world):
    """Found by the DC-ASGD hostile review: float16 parameters, one trainer (w_now == w_sent:
    nothing to compensate), a gradient of 3000 (lambda * g * g overflows float16). The update is
    torch's, p - lr * g; before, lambda * g * g * 0 was inf * 0, NaN."""
    name, lam, lr = job("dc-half"), 0.5, 1e-4
    w0 = world.run({"trainer0": (r.build_with, name, lam, lr, 1, "linear", torch.float16)})["trainer0"]
    g = world.run({"trainer0": (r.backward_linear, name, 3000.0)})["trainer0"]
    world.run({"trainer0": (r.step, name)})
    after = world.run({"trainer0": (r.values, name)})["trainer0"]
    assert after["p"].dtype == torch.float16
    torch.testing.assert_close(after["p"], w0["p"] - lr * g["p"], rtol=0, atol=1e-3)


def test_complex_parameters_are_compensated_as_pairs_of_reals_as_torchs_optimizers_step_them(world):
    """Found by the DC-ASGD hostile review: torch's optimizers step a complex parameter as its
    real and imaginary parts (view_as_real), and DC-ASGD's g * g is the diagonal of the
    gradient's outer product, per real coordinate. The compensation took the complex square
    instead: for a gradient i*a, g * g = -a**2, compensating the wrong way."""
    name, lam, lr = job("dc-complex"), 0.5, 0.1
    got = interleaved(world, name, (r.build_complex, name, lam, lr), r.backward_complex)
    w0, w1, w2, late = got["w0"], got["w1"], got["w2"], got["late"]
    for k in w0:
        g, d = torch.view_as_real(late["grads"][k]), torch.view_as_real(w1[k] - w0[k])
        compensated = torch.view_as_complex((g + lam * g * g * d).contiguous())
        assert float(d.abs().max()) > 1e-3  # (trainer0's step moved it: something to compensate)
        torch.testing.assert_close(w2[k], w1[k] - lr * compensated, rtol=0, atol=1e-5)


def test_async_training_of_the_tutorial_model_with_dc_asgd_halves_its_loss_with_two_trainers(world):
    name = job("dc-tutorial")
    got = world.run({"trainer0": (r.train_tutorial, name, 0, 60, 0.04),
                     "trainer1": (r.train_tutorial, name, 1, 60, 0.04)})
    for who, losses in got.items():
        assert losses["after"] <= 0.5 * losses["before"], (who, losses)


@pytest.mark.parametrize("ps_mode", ["sync", "half_async", "geo"])
def test_dc_asgd_with_another_mode_is_a_value_error_naming_it(ps_mode):
    # (checked before anything is sent: no RPC world needed)
    with pytest.raises(ValueError, match=f"dc_asgd=0.1 needs ps_mode='async'.*got ps_mode='{ps_mode}'"):
        PSModel(nn.Linear(2, 2), ["ps0"], name="dc-bad", num_trainers=1, ps_mode=ps_mode, dc_asgd=0.1)


@pytest.mark.parametrize("value", [-0.1, float("nan"), float("inf"), True, "0.1",
                                   pytest.param(10 ** 400, id="10**400"), np.float32(-1), torch.tensor(0.1)])
def test_a_bad_dc_asgd_is_a_value_error_naming_the_value(value):
    # (10 ** 400: found by the DC-ASGD hostile review, an OverflowError before)
    with pytest.raises(ValueError, match=f"dc_asgd must be a finite number >= 0.*got {re.escape(repr(value))}"):
        PSModel(nn.Linear(2, 2), ["ps0"], name="dc-bad", num_trainers=1, ps_mode="async", dc_asgd=value)


@pytest.mark.parametrize("value", [np.float32(0.25), np.float64(0.25), np.int64(1), Fraction(1, 4)])
def test_dc_asgd_takes_any_real_number_as_the_other_numeric_settings(value):
    """Found by the DC-ASGD hostile review: numpy's float32 and int64 (a lambda read from a
    config array) were refused as "must be a finite number, got np.float32(0.25)", numpy's
    float64 taken; any numbers.Real is taken now, as timeouts are (positive_seconds)."""
    from remote_module.ps.dense._model import _dc_asgd_lambda

    got = _dc_asgd_lambda(value, "async")
    assert type(got) is float and got == float(value)
    with pytest.raises(ValueError, match=re.escape(f"dc_asgd={value!r} needs ps_mode='async'")):
        _dc_asgd_lambda(value, "sync")
