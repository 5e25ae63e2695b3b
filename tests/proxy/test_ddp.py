"""DistributedDataParallel around a whole hybrid model that holds a RemoteModule.

DDP walks every submodule with ``named_parameters(recurse=False)`` and friends; the proxy
answers with nothing, so DDP syncs the local MLP while the remote embedding trains through
distributed autograd and ``DistributedOptimizer`` (tests/proxy/_ddp_remote.py runs the job).
"""

import io

import pytest
import torch
from torch import nn

from rpc_backend import run_local
from tests._deadlines import HANG_S, SETUP_S
from tests.proxy import _ddp_remote
from tests.proxy._ddp_remote import DIM, LR, NUM_EMBEDDINGS, HybridModel, batch

STEPS = 3


def _load(data: bytes) -> dict:
    return torch.load(io.BytesIO(data))


def _reference(initial: dict, steps: int) -> dict:
    """The same training on one process: DDP averages the MLP's gradients over the two
    trainers; each trainer's optimizer applies its own full gradient to the shared table."""
    model = HybridModel(nn.EmbeddingBag(NUM_EMBEDDINGS, DIM, mode="sum"))
    model.load_state_dict(initial)
    mlp, table = list(model.mlp.parameters()), model.embedding.weight
    for step in range(steps):
        loss = sum(
            nn.functional.cross_entropy(model(ids, offsets), labels)
            for ids, offsets, labels in (batch(0, step), batch(1, step))
        )
        *mlp_grads, table_grad = torch.autograd.grad(loss, [*mlp, table])
        with torch.no_grad():
            for p, g in zip(mlp, mlp_grads):
                p -= LR * g / 2
            table -= LR * table_grad
    return model.state_dict()


@pytest.mark.slow
def test_ddp_around_a_model_holding_a_remote_module():
    results = run_local(_ddp_remote.trainer_main, 3, roles={"ps": 1, "trainer": 2}, args=(STEPS,),
                        rpc_timeout=SETUP_S, timeout=SETUP_S + HANG_S)
    assert results[0] is None
    (init0, final0), (init1, final1) = [(_load(r["initial"]), _load(r["final"])) for r in results[1:]]
    keys = {"embedding.weight", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias"}
    assert set(init0) == set(final0) == set(final1) == keys
    for key in keys:  # DDP broadcast trainer0's MLP; both see the one remote table
        assert torch.equal(init0[key], init1[key]), key
    expected = _reference(init0, STEPS)
    for key in keys:
        assert torch.allclose(final0[key], final1[key], atol=1e-6, rtol=0), key
        assert torch.allclose(final0[key], expected[key], atol=1e-5, rtol=0), key
        assert not torch.allclose(final0[key], init0[key], atol=1e-4), f"{key} did not train"
