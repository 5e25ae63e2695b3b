"""What tests/ps/test_table_weight_and_refusal_messages.py runs on its trainers."""

from __future__ import annotations

import torch
from torch import nn

ROWS, DIM = 12, 3


def given_rows() -> torch.Tensor:
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(11))


def weight_idioms(name: str, init: str, cls: str) -> dict:
    """The torch idioms that start a table from given rows (``table.weight.data = W``,
    ``table.weight = nn.Parameter(W)``), on a sharded table: what each raised, whether it
    changed the table, then the call the error names, and the rows it leaves."""
    import remote_module.ps as ps

    make = ps.ShardedEmbeddingBag if cls == "bag" else ps.ShardedEmbedding
    kwargs = {"mode": "sum"} if cls == "bag" else {}
    table = make(ROWS, DIM, ["ps0", "ps1"], name=name, init=init, **kwargs)
    W = given_rows()
    out: dict = {"hasattr": hasattr(table, "weight")}
    for idiom in ("data", "parameter"):
        try:
            if idiom == "data":
                table.weight.data = W
            else:
                table.weight = nn.Parameter(W)
            out[idiom] = None
        except AttributeError as exc:
            out[idiom] = str(exc)
    out["parameters"] = [n for n, _ in table.named_parameters()]
    if init == "lazy":
        table.load_state_dict({"weight.ids": torch.arange(len(W)), "weight.rows": W})
    else:
        table.load_state_dict({"weight": W})
    with torch.no_grad():
        ids = torch.arange(ROWS)
        out["rows"] = table(ids, ids) if cls == "bag" else table(ids)  # (each bag one row)
    return out


def refused_step(name: str, trainer: int) -> dict:
    """Two sync trainers of one bag; trainer1's lr differs at its third step (index 2), which
    the servers refuse: what each trainer's next lookup raised (type, message)."""
    from remote_module.ps import ShardedEmbeddingBag, StepRefused

    table = ShardedEmbeddingBag(ROWS, DIM, ["ps0"], name=name, mode="sum", ps_mode="sync", num_trainers=2,
                                optimizer=(torch.optim.SGD, {"lr": 0.5}), timeout=20)
    caught = []
    k = 0
    while k < 4 and len(caught) < 2:
        table.ps_optimizer.param_groups[0]["lr"] = 0.25 if (trainer == 1 and k == 2) else 0.5
        ids = torch.tensor([k % ROWS, (k + 1) % ROWS])
        try:
            out = table(ids, torch.tensor([0]))
        except StepRefused as exc:
            caught.append((k, type(exc).__name__, isinstance(exc, ValueError), str(exc)))
            continue
        out.sum().backward()
        table.step()
        k += 1
    table.flush()
    return {"caught": caught}
