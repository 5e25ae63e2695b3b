"""What the retry tests of tests/ps/test_embedding_faults.py run on trainer0: async retries of
a step that failed on a frozen ps1 after ps0 applied its part, compared with torch."""

from __future__ import annotations

import torch
from torch import nn

from tests.ps._embedding_edge_cases_remote import _objects, attempt, table, weights


def table_prepare(name: str, optimizer: tuple) -> bool:
    """An async ShardedEmbedding (rows 0-9 on ps0, 10-19 on ps1), a backward of ids [1, 15] done
    (no timeout of its own: the test sets the one it tests once the fault holds)."""
    t = table(name, ps_mode="async", optimizer=optimizer)
    t(torch.tensor([1, 15])).pow(2).sum().backward()
    return True


def table_do(name: str, what: str, ids: list | None = None) -> dict:
    t = _objects[name]
    return attempt({
        "step": t.step,
        "flush": t.flush,
        "backward": lambda: t(torch.tensor(ids)).pow(2).sum().backward(),
        "retry": lambda: (t.step(), t.flush()),
        "train": lambda: (t(torch.tensor(ids)).pow(2).sum().backward(), t.step(), t.flush()),
        "rows": lambda: t.state_dict()["weight"],
    }[what])


def table_torch(optimizer: tuple, steps: list) -> torch.Tensor:
    """torch's rows after one step per list of ids in ``steps``."""
    emb = nn.Embedding(20, 3, sparse=True, _weight=weights(0))
    opt = optimizer[0](emb.parameters(), **optimizer[1])
    for ids in steps:
        opt.zero_grad()
        emb(torch.tensor(ids)).pow(2).sum().backward()
        opt.step()
    return emb.weight.detach()


class Branchy(nn.Module):
    """``a`` and ``c`` (on ps0), ``b`` (on ps1); ``c`` used only when ``use_c``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 2)
        self.b = nn.Linear(2, 1)
        self.c = nn.Parameter(torch.full((2,), 1.5))

    def forward(self, x: torch.Tensor, use_c: bool = True) -> torch.Tensor:
        h = self.a(x)
        if use_c:
            h = h * self.c
        return self.b(h)


def _split(names: list, servers: list) -> list:
    return ["ps1" if n.startswith("b.") else "ps0" for n in names]


X = torch.linspace(-1, 1, 12).reshape(3, 4)


def model_prepare(name: str, optimizer: tuple) -> bool:
    """An async PSModel of :class:`Branchy`, its gradients ready (no timeout of its own, as
    :func:`table_prepare`)."""
    from remote_module.ps import PSModel

    ps = PSModel(Branchy(), ["ps0", "ps1"], name=name, ps_mode="async", num_trainers=1,
                 min_block_size=1 << 20, split_method=_split, optimizer=optimizer)
    _objects[name] = ps
    ps(X).pow(2).sum().backward()
    return True


def model_do(name: str, what: str, use_c: bool = True) -> dict:
    ps = _objects[name]
    return attempt({
        "step": ps.step,
        "forward": lambda: ps(X, use_c=use_c).pow(2).sum().backward(),
        "retry": lambda: (ps.step(), ps.flush()),
        "values": lambda: {s.pname: ps._server_values()[s.name].clone() for s in ps._slots},
    }[what])


def model_torch(optimizer: tuple, uses: list) -> dict:
    """torch's parameters after one step (zero_grad first) per forward, ``uses``: use_c of each."""
    model = Branchy()
    opt = optimizer[0](model.parameters(), **optimizer[1])
    for use_c in uses:
        opt.zero_grad()
        model(X, use_c=use_c).pow(2).sum().backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}
