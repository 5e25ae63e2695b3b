"""Errors that say what to do: a sharded table's missing ``weight`` (``table.weight.data = W``,
dlrm's way of starting a table from given rows) names the call that does it, and a refused sync
step is a public exception whose message says how its steps are numbered."""

from __future__ import annotations

import pytest
import torch

import remote_module.ps as ps
from tests.ps import _table_advice_remote as r
from tests.ps._world import job

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def world(ps_world):  # shared with the other PS tests (tests/conftest.py)
    return ps_world


@pytest.mark.parametrize("init,cls", [("eager", "bag"), ("lazy", "bag"), ("eager", "embedding")])
def test_table_weight_names_load_state_dict_and_the_named_call_starts_the_table(world, init, cls):
    got = world.run({"trainer0": (r.weight_idioms, job(f"weight-{init}-{cls}"), init, cls)})["trainer0"]
    assert got["hasattr"] is False
    call = ('load_state_dict({"weight.ids": torch.arange(len(W)), "weight.rows": W})' if init == "lazy"
            else 'load_state_dict({"weight": W})')
    for idiom in ("data", "parameter"):
        assert got[idiom] is not None and call in got[idiom], got[idiom]
    assert got["data"].startswith(f"'Sharded{'EmbeddingBag' if cls == 'bag' else 'Embedding'}' object has no "
                                  "attribute 'weight'"), got["data"]
    assert "weight" not in got["parameters"]  # the refused assignment registered nothing
    torch.testing.assert_close(got["rows"], r.given_rows(), rtol=0, atol=0)


def test_a_refused_sync_step_is_a_public_step_refused_counting_steps_from_0(world):
    assert issubclass(ps.StepRefused, ValueError) and issubclass(ps.StepNotApplied, RuntimeError)
    name = job("refused-words")
    got = world.run({f"trainer{t}": (r.refused_step, name, t) for t in range(2)})
    for t in ("trainer0", "trainer1"):
        caught = got[t]["caught"]
        assert [(k, kind, value_error) for k, kind, value_error, _ in caught] == [(3, "StepRefused", True)], caught
        message = caught[0][3]
        # trainer1's third step (index 2) was refused: the message says how steps are numbered
        assert "step 2 (counting steps from 0) was refused (refusal 1)" in message, message
