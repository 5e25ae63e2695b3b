"""What tests/ps/test_table_checkpoints.py runs on its trainers: weights-only loads of tables
that keep optimizer state."""

from __future__ import annotations

from typing import Any

import torch

ROWS, DIM = 40, 3
ADAGRAD = (torch.optim.Adagrad, {"lr": 0.5})


def bag(name: str, servers: list[str], init: str = "lazy", optimizer: tuple = ADAGRAD, **kwargs: Any):
    from remote_module.ps import ShardedEmbeddingBag

    return ShardedEmbeddingBag(ROWS, DIM, servers, name=name, mode="sum", init=init, optimizer=optimizer,
                               min_block_size=ROWS // 2 * DIM, **kwargs)


def initial(name: str) -> torch.Tensor:
    """Every row's first value of the table ``name`` (seed 0): a local module's weight."""
    from remote_module.ps._rows import initial_rows, row_key

    return initial_rows(row_key(0, name), torch.arange(ROWS), DIM)


#: each step's bags (input, offsets): rows 4, 5 first stepped after the checkpoint (step 1)
BAGS = [(torch.tensor([1, 2, 3, 1]), torch.tensor([0, 2])),
        (torch.tensor([3, 4, 5, 4]), torch.tensor([0, 1])),
        (torch.tensor([2, 3, 4, 5, 6]), torch.tensor([0, 3]))]


def bag_weights(k: int) -> torch.Tensor:
    return torch.randn(2, DIM, generator=torch.Generator().manual_seed(10 + k))


def every_row(module: Any) -> torch.Tensor:
    """Each row of a bag module (sharded or local), as a one-row bag."""
    with torch.no_grad():
        return module(torch.arange(ROWS), torch.arange(ROWS)).detach().clone()


def weights_only_load(name: str, init: str) -> dict:
    """An Adagrad bag table stepped on BAGS[0], saved (weights only), stepped on BAGS[1],
    loaded back (weights only), stepped on BAGS[2]: its rows after the load and at the end,
    and its optimizer state at the end."""
    emb = bag(name, ["ps0", "ps1"], init)

    def step(k: int) -> None:
        (emb(*BAGS[k]) * bag_weights(k)).sum().backward()
        emb.step()

    step(0)
    saved = emb.state_dict()
    step(1)
    emb.load_state_dict(saved)
    loaded = every_row(emb)
    step(2)
    state = emb.optimizer_state_dict()
    return {"loaded": loaded, "rows": every_row(emb), "ids": state["ids"], "sum": state["sum"],
            "step": state["step"]}


def weights_then_optimizer(name: str) -> dict:
    """A lazy Adagrad table: a full checkpoint after BAGS[0], a step on BAGS[1], then the
    checkpoint loaded (weights first): its stored ids, optimizer state ids and rows held."""
    emb = bag(name, ["ps0", "ps1"])
    for k in (0, 1):
        (emb(*BAGS[k]) * bag_weights(k)).sum().backward()
        emb.step()
        if k == 0:
            saved = emb.state_dict(), emb.optimizer_state_dict()
    emb.load_state_dict(saved[0])
    emb.load_optimizer_state_dict(saved[1])
    return {"ids": emb.state_dict()["weight.ids"].tolist(), "state_ids": emb.optimizer_state_dict()["ids"].tolist(),
            "held": emb.table_stats()["rows_held"], "saved_ids": saved[0]["weight.ids"].tolist()}
