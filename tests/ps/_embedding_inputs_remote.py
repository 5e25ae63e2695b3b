"""What tests/ps/test_embedding_edge_cases.py runs for its input tests: max pooling with ties and
non-finite rows, and lookups of every odd shape, on sharded tables (or, given no name, on
the local modules pytest compares them with)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from tests.ps._embedding_edge_cases_remote import table, weights


def max_weights() -> torch.Tensor:
    """weights(0) with row 1 (on ps0) equal to row 15 (on ps1), rows 3 and 13 at -inf, and a
    NaN in row 4 (dimension 0)."""
    w = weights(0)
    w[1] = w[15]
    w[3] = float("-inf")
    w[13] = float("-inf")
    w[4, 0] = float("nan")
    return w


#: bags (offsets form): ties both ways round, a -inf row alone, -inf rows on both servers, a NaN
#: row first / later, a bag of ps0's rows only
MAX_IDS = [15, 1, 1, 15, 13, 2, 4, 15, 15, 4, 2, 4, 3, 13]
MAX_OFFSETS = [0, 2, 4, 5, 6, 8, 10, 12]


def max_bag_step(bag: nn.Module, step: Callable[[], None]) -> torch.Tensor:
    """One max-pooled lookup of MAX_IDS, backward of a weighted sum, one step: the output."""
    out = bag(torch.tensor(MAX_IDS), torch.tensor(MAX_OFFSETS))
    c = torch.arange(1.0, 1.0 + out.numel()).reshape(out.shape)
    (out * c).sum().backward()  # each element's gradient is distinct: the row it reaches shows
    step()
    return out.detach()


def max_pooling(name: str) -> dict:
    t = table(name, bag="max", seed=None)
    t.load_state_dict({"weight": max_weights()})
    out = max_bag_step(t, t.step)
    return {"out": out, "rows": t.state_dict()["weight"]}


# ---- inputs of every odd shape ---------------------------------------------------------------------------


def odd_inputs() -> dict:
    """(module kind, args) for lookups an ordinary user makes: empty, 0-d, int32, bags that are
    empty / huge / full of one id, ids on the block boundary (rows 9 | 10), negative padding."""
    g = torch.Generator().manual_seed(7)
    huge = torch.randint(0, 20, (5000,), generator=g)
    return {
        "emb empty": ("emb", (torch.empty(0, dtype=torch.long),)),
        "emb empty 2-d": ("emb", (torch.empty(3, 0, dtype=torch.long),)),
        "emb 0-d": ("emb", (torch.tensor(10),)),
        "emb int32 boundary": ("emb", (torch.tensor([[9, 10], [10, 9]], dtype=torch.int32),)),
        "emb padding -1": ("pad", (torch.tensor([19, 0, 19]),)),
        "sum empty input": ("sum", (torch.empty(0, dtype=torch.long), torch.tensor([0, 0]))),
        "sum empty bags": ("sum", (torch.tensor([1, 15]), torch.tensor([0, 0, 1, 2, 2]))),
        "sum int32": ("sum", (torch.tensor([9, 10, 10], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32))),
        "sum duplicates": ("sum", (torch.tensor([[3, 3, 3, 3]]),)),
        "sum psw": ("sum", (torch.tensor([9, 10, 10]), torch.tensor([0, 1]), torch.tensor([0.5, 2.0, -1.0]))),
        # (torch pools with another kernel when a module has a padding_idx, even one no input uses)
        "sum psw padding unused": ("sum-pad", (torch.tensor([[1, 2], [3, 4]]), None,
                                               torch.tensor([[0.5, 2.0], [1.0, 3.0]]))),
        "mean huge bag": ("mean", (huge, torch.tensor([0, 1]))),
        "mean empty bags": ("mean", (torch.tensor([1, 15]), torch.tensor([0, 0, 2]))),
        "max huge bag": ("max", (huge, torch.tensor([0]))),
        "max empty bags": ("max", (torch.tensor([1, 15]), torch.tensor([0, 2, 2]))),
        "max padding -1 only": ("max-pad", (torch.tensor([[19, 19], [1, 19]]),)),
        "psw short": ("sum", (torch.tensor([9, 10, 10]), torch.tensor([0, 1]), torch.tensor([0.5, 2.0]))),
        "psw float64": ("sum", (torch.tensor([9, 10]), torch.tensor([0]),
                                torch.tensor([0.5, 2.0], dtype=torch.float64))),
        "psw with mean": ("mean", (torch.tensor([9, 10]), torch.tensor([0]), torch.tensor([0.5, 2.0]))),
        "offsets not from 0": ("sum", (torch.tensor([9, 10]), torch.tensor([1]))),
        "offsets past the end": ("sum", (torch.tensor([9, 10]), torch.tensor([0, 3]))),
        "offsets decreasing": ("sum", (torch.tensor([9, 10, 11, 12]), torch.tensor([0, 3, 1]))),
    }


def _one_server(names: list, servers: list) -> list:
    """A split_method putting every block on the first server."""
    return [servers[0]] * len(names)


#: how odd_modules() lays a sharded table out: over ps0 and ps1 (two blocks), or held whole
#: by ps0 (a lookup that records nothing is then pooled there in one step), eager, lazy, or in
#: two blocks on ps0
LAYOUTS = {
    "two servers": {},
    "one server": {"servers": ["ps0"]},
    "one server, lazy": {"servers": ["ps0"], "init": "lazy"},
    "one server, two blocks": {"split_method": _one_server},
}


def odd_modules(name: str | None, layout: str = "two servers") -> dict:
    """The modules odd_inputs() name: sharded (``name``, laid out as ``LAYOUTS[layout]``) or,
    with None, local ones."""
    w = weights(0)
    if name is None:
        local = {"emb": nn.Embedding(20, 3, _weight=w.clone()),
                 "pad": nn.Embedding(20, 3, padding_idx=-1, _weight=w.clone())}
        local.update({m: nn.EmbeddingBag(20, 3, mode=m, _weight=w.clone()) for m in ("sum", "mean", "max")})
        local["max-pad"] = nn.EmbeddingBag(20, 3, mode="max", padding_idx=-1, _weight=w.clone())
        local["sum-pad"] = nn.EmbeddingBag(20, 3, mode="sum", padding_idx=-1, _weight=w.clone())
        return local  # the padding row as loaded (non-zero): nn.Embedding returns it as stored
    kw = LAYOUTS[layout]
    out = {"emb": table(f"{name}-emb", keep=False, **kw), "pad": table(f"{name}-pad", padding_idx=-1, keep=False, **kw)}
    out.update({m: table(f"{name}-{m}", bag=m, keep=False, **kw) for m in ("sum", "mean", "max")})
    out["max-pad"] = table(f"{name}-max-pad", bag="max", padding_idx=-1, keep=False, **kw)
    out["sum-pad"] = table(f"{name}-sum-pad", bag="sum", padding_idx=-1, keep=False, **kw)
    return out


def odd_lookups(name: str | None, grad: bool = True, layout: str = "two servers") -> dict:
    """Each of odd_inputs() on odd_modules(name, layout): the output and the stepped gradient's
    rows, or the refusal's type and message; with ``grad=False`` under ``torch.no_grad()`` (a
    lookup that records nothing takes a shorter path on the trainer, and of a table one server
    holds, none: that server checks and pools the arguments as given)."""
    modules = odd_modules(name, layout)
    out = {}
    for case, (kind, args) in odd_inputs().items():
        module = modules[kind]
        try:
            with torch.set_grad_enabled(grad):
                got = module(*args)
        except Exception as exc:  # noqa: BLE001 - compared with torch's
            out[case] = (type(exc).__name__, str(exc).split("\n")[0])
            continue
        out[case] = (got.dtype, got.detach())
    return out


def last_offset_lookups(name: str | None) -> dict:
    """Bags given with ``include_last_offset=True`` (torch's CSR form), alone and in a
    collection: each mode's output and, after one SGD step (lr 1), the rows; the refusals'
    type and message; with None, local ``nn.EmbeddingBag``s (pytest compares)."""
    ids, offsets = torch.tensor([1, 15, 2, 2, 9, 19]), torch.tensor([0, 2, 2, 5, 6])
    out: dict = {}
    for mode in ("sum", "mean", "max"):
        if name is None:
            module = nn.EmbeddingBag(20, 3, mode=mode, include_last_offset=True, _weight=weights(0).clone())
            opt = torch.optim.SGD(module.parameters(), lr=1.0)
            got = module(ids, offsets)
            got.pow(2).sum().backward()
            opt.step()
            out[mode] = (got.detach(), module.weight.detach().clone())
        else:
            from remote_module.ps import ShardedEmbeddingBagCollection

            module = table(f"{name}-{mode}", bag=mode, include_last_offset=True, keep=False)
            other = table(f"{name}-{mode}-other", bag="sum", keep=False)
            together = ShardedEmbeddingBagCollection({"t": module, "o": other})({"t": (ids, offsets),
                                                                                 "o": (ids, offsets[:-1])})
            got = module(ids, offsets)
            assert torch.equal(got, together["t"]), mode
            got.pow(2).sum().backward()
            other.zero_grad()
            module.step()
            out[mode] = (got.detach(), module.state_dict()["weight"])
    refusals = {"no offsets": (ids, torch.tensor([], dtype=torch.long)), "last not the end": (ids, offsets[:-1])}
    module = (nn.EmbeddingBag(20, 3, mode="sum", include_last_offset=True) if name is None
              else table(f"{name}-refusals", bag="sum", include_last_offset=True, keep=False))
    for case, args in refusals.items():
        try:
            module(*args)
            out[case] = "no error"
        except Exception as exc:  # noqa: BLE001 - compared with torch's
            out[case] = (type(exc).__name__, str(exc).split("\n")[0])
    return out
