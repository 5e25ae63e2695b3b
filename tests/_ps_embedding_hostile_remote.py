"""What tests/test_ps_embedding_hostile.py runs on its trainers: sharded tables used as an
ordinary PyTorch user would (the torch idioms, the mistakes, the threads), each returning what
happened to pytest, which compares it with plain torch."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import torch
from torch import nn

SERVERS = ["ps0", "ps1"]

#: this process's tables (and models) by name, kept between calls
_objects: dict[str, Any] = {}


def attempt(fn: Callable[[], Any]) -> dict:
    """How ``fn()`` ended: ``ok``, its value or exception type and message, and seconds taken."""
    start = time.monotonic()
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - returned to the test
        return {"ok": False, "type": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start}
    return {"ok": True, "value": value, "seconds": time.monotonic() - start}


def weights(seed: int, rows: int = 20, dim: int = 3) -> torch.Tensor:
    return torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed))


def table(name: str, rows: int = 20, dim: int = 3, *, bag: str | None = None, seed: int | None = 0,
          keep: bool = True, **kwargs: Any):
    """A ShardedEmbedding (or, with ``bag``, a ShardedEmbeddingBag of that mode) over ps0, ps1
    in two blocks, loaded with ``weights(seed)`` unless ``seed`` is None."""
    from remote_module.ps import ShardedEmbedding, ShardedEmbeddingBag

    kwargs.setdefault("min_block_size", 1)
    kwargs.setdefault("optimizer", (torch.optim.SGD, {"lr": 1.0}))
    servers = kwargs.pop("servers", SERVERS)
    if bag is None:
        t = ShardedEmbedding(rows, dim, servers, name=name, **kwargs)
    else:
        t = ShardedEmbeddingBag(rows, dim, servers, name=name, mode=bag, **kwargs)
    if seed is not None:
        t.load_state_dict({"weight": weights(seed, rows, dim)})
    if keep:
        _objects[name] = t
    return t


def try_table(name: str, **kwargs: Any) -> dict:
    return attempt(lambda: table(name, keep=True, **kwargs) and None)


def rows_of(name: str) -> torch.Tensor:
    return _objects[name].state_dict()["weight"]


# ---- the torch idioms of a training loop ------------------------------------------------------------


def idioms(emb: nn.Module, step: Callable[[], None], zero_grad: Callable[[], None]) -> None:
    """A training loop's idioms on ``emb`` (a sharded table, or a local ``nn.Embedding`` with
    its optimizer's ``step`` / ``zero_grad``): pytest compares the rows after it."""
    x = [torch.tensor(ids) for ids in ([1, 15, 1], [2, 16], [16, 3, 3], [4, 17], [5, 18], [6], [7, 19])]
    out = emb(x[0]).pow(2).sum()
    zero_grad()  # between forward and backward, as many loops do: the backward after it counts
    out.backward()
    step()
    zero_grad()
    emb(x[1]).sum().backward()  # two backwards before a step: the gradients add up
    emb(x[2]).pow(2).sum().backward()
    step()
    zero_grad()
    out = emb(x[3]).pow(2).sum()
    out.backward(retain_graph=True)  # backward twice through one graph: twice the gradient
    out.backward()
    step()
    zero_grad()
    with torch.no_grad():
        emb(x[4])
    step()  # after a lookup under no_grad, and with nothing looked up: nothing moves
    step()
    emb(x[5])  # a lookup never backpropagated
    step()
    zero_grad()
    emb(x[6]).sum().backward()
    zero_grad()  # dropped before the step
    step()


def idioms_sharded(name: str, optimizer: tuple) -> torch.Tensor:
    t = table(name, optimizer=optimizer)
    idioms(t, t.step, t.zero_grad)
    return t.state_dict()["weight"]


def idioms_in_psmodel(name: str) -> dict:
    """The same idioms through a PSModel holding the table and a Linear."""
    from remote_module.ps import PSModel

    t = table(name + "-table")
    torch.manual_seed(0)
    model = PSModel(nn.Sequential(t, nn.Linear(3, 1)), ["ps2"], name=name, num_trainers=1, mode="async",
                    optimizer=(torch.optim.SGD, {"lr": 1.0}))
    idioms(model, model.step, model.zero_grad)
    return dict(model.state_dict())


def graph_leaf(out: torch.Tensor) -> torch.Tensor:
    """The first leaf tensor of ``out``'s autograd graph."""
    fn = out.grad_fn
    while not hasattr(fn, "variable"):
        fn = next(f for f, _ in fn.next_functions if f is not None)
    return fn.variable


def dropped_lookup_is_freed(name: str) -> dict:
    """A lookup whose output is dropped without backward (an eval loop without no_grad) leaves
    nothing behind: its rows (the leaf of the output's graph) are freed with the output."""
    import gc
    import weakref

    t = table(name)
    alive = []
    for _ in range(3):
        out = t(torch.tensor([1, 15]))
        leaf = graph_leaf(out)  # the rows the output was indexed from
        ref = weakref.ref(leaf)
        del out, leaf
        gc.collect()
        alive.append(ref() is not None)
    return {"alive": alive}


# ---- optimizer state of tables stepped on some servers only ----------------------------------------


#: per step, the ids looked up: rows 0-9 are on ps0, 10-19 on ps1
ONE_SIDE_THEN_BOTH = ([[15, 16], [16]], [[1, 2], [2]], [[1, 15], [3, 18]])


def train_steps(t: nn.Module, steps: list[list[int]], step: Callable[[], None]) -> None:
    for ids in steps:
        t(torch.tensor(ids)).pow(2).sum().backward()
        step()


def one_side_state(name: str, optimizer: tuple, steps: list[list[int]]) -> dict:
    """Train a table on ``steps`` (each may touch one server only), then its optimizer state, and
    the rows of a second table loaded with both checkpoints and trained one step further."""
    t = table(name, optimizer=optimizer)
    train_steps(t, steps, t.step)
    state = attempt(t.optimizer_state_dict)
    out = {"state": state, "rows": t.state_dict()["weight"]}
    if state["ok"]:
        again = table(name + "-again", optimizer=optimizer, seed=None)
        again.load_state_dict(t.state_dict())
        again.load_optimizer_state_dict(state["value"])
        train_steps(again, [[1, 16]], again.step)
        out["continued"] = again.state_dict()["weight"]
    return out


# ---- two objects of one table on one trainer ---------------------------------------------------------


SYNC2 = dict(ps_mode="sync", num_trainers=2)


def two_objects_of_one_table(name: str) -> dict:
    """trainer0 of a sync table of 2 trainers: two objects of the table, the older one's step
    (refused), then the newer one's; the rows after the step."""
    older = table(name, keep=False, **SYNC2)
    newer = table(name, keep=False, **SYNC2)
    older(torch.tensor([1, 15])).sum().backward()
    refused = attempt(older.step)
    newer(torch.tensor([2, 16])).sum().backward()
    newer.step()
    return {"older": refused, "rows": newer.state_dict()["weight"]}


def one_sync_step(name: str, ids: list[int]) -> torch.Tensor:
    t = table(name, keep=False, **SYNC2)
    t(torch.tensor(ids)).sum().backward()
    t.step()
    return t.state_dict()["weight"]


# ---- servers that freeze or die, trainers that die ---------------------------------------------------


def prepare(name: str, ids: list[int] | None, **kwargs: Any) -> bool:
    """A table kept here, with a lookup of ``ids`` backpropagated (its gradient waits for a step)."""
    t = table(name, **kwargs)
    if ids is not None:
        t(torch.tensor(ids)).pow(2).sum().backward()
    return True


def timed(name: str, what: str, timeout: float, ids: list[int] | None = None) -> dict:
    """``what`` ("lookup", "step", "backward", "rows") on table ``name`` with ``timeout``: how it ended."""
    t = _objects[name]
    t.timeout = timeout
    ids_t = torch.tensor(ids if ids is not None else [1, 15])
    return attempt({
        "lookup": lambda: t(ids_t).detach(),
        "step": t.step,
        "backward": lambda: t(ids_t).pow(2).sum().backward(),
        "rows": lambda: t.state_dict()["weight"],
    }[what])


def waiters(name: str) -> int:
    """On a server: the sync lookups of table ``name`` still waiting."""
    from remote_module.ps import _tables

    table = _tables._table(name)
    with table.lock:
        return len(table.waiters)


# ---- max pooling with ties and non-finite rows -------------------------------------------------------


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


# ---- checkpoints that do not fit ---------------------------------------------------------------------


def misfit_checkpoints(name: str) -> dict:
    """A lazy 40-row table's checkpoints (rows 1 and 35 touched) loaded where they do not fit;
    each outcome and whether the target's rows changed."""
    big = table(name + "-40", rows=40, init="lazy", seed=None, optimizer=(torch.optim.Adagrad, {"lr": 0.1}))
    big(torch.tensor([1, 35])).sum().backward()
    big.step()
    sd, osd = big.state_dict(), big.optimizer_state_dict()
    small = table(name + "-20", rows=20, init="lazy", seed=None, optimizer=(torch.optim.Adagrad, {"lr": 0.1}))
    wide = table(name + "-wide", rows=40, dim=5, init="lazy", seed=None)
    eager = table(name + "-eager", rows=20, seed=0)
    before = {"small": small.state_dict(), "wide": wide.state_dict(), "eager": eager.state_dict()}
    out = {
        "small strict": attempt(lambda: small.load_state_dict(sd)),
        "small not strict": attempt(lambda: small.load_state_dict(sd, strict=False)),
        "small optimizer": attempt(lambda: small.load_optimizer_state_dict(osd)),
        "wide": attempt(lambda: wide.load_state_dict(sd, strict=False)),
        "extra key strict": attempt(lambda: eager.load_state_dict({"weight": weights(1), "bias": torch.zeros(3)})),
        "extra key not strict": attempt(lambda: list(eager.load_state_dict(
            {"weight": weights(2), "bias": torch.zeros(3)}, strict=False).unexpected_keys)),
    }
    after = {"small": small.state_dict(), "wide": wide.state_dict(), "eager": eager.state_dict()}
    out["unchanged"] = {k: all(torch.equal(before[k][key], after[k][key]) for key in before[k]) for k in before}
    out["eager rows"] = after["eager"]["weight"]
    return out


def mismatched_attach(name: str, kwargs: dict) -> dict:
    """Attach to table ``name`` (built by another trainer with table()'s defaults) with ``kwargs``."""
    return attempt(lambda: table(name, keep=False, seed=None, num_trainers=2, **kwargs) and None)


def table_named(name: str) -> bool:
    table(name, num_trainers=2)
    return True


# ---- memory on the servers ------------------------------------------------------------------------------


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def table_bytes(name: str) -> int:
    """On a server: the bytes table ``name`` holds here (rows and optimizer state)."""
    from remote_module.ps import _tables

    return _tables._table_memory(name)


def big_tables(name: str) -> dict:
    """An eager and a lazy 1,000,000 x 16 table with SparseAdam; the lazy one trained on 1,000
    rows: what each server holds after creation and after the step."""
    eager = table(name + "-eager", rows=1_000_000, dim=16, seed=None, optimizer=(torch.optim.SparseAdam, {"lr": 0.1}))
    lazy = table(name + "-lazy", rows=1_000_000, dim=16, seed=None, init="lazy",
                 optimizer=(torch.optim.SparseAdam, {"lr": 0.1}))
    ids = torch.randperm(1_000_000, generator=torch.Generator().manual_seed(0))[:1000]
    lazy(ids).sum().backward()
    lazy.step()
    del eager
    return {"touched": 1000}


# ---- threads, a tied table, a load while another trainer trains -------------------------------------------


def threads_train(name: str, threads: int, steps: int) -> dict:
    """``threads`` threads of this trainer share one async table (SGD, lr 1), each looking up
    its own ids and stepping ``steps`` times (gradient 1 per occurrence): the rows after."""
    t = table(name, ps_mode="async")
    start = threading.Barrier(threads)
    errors: list[str] = []

    def run(k: int) -> None:
        try:
            start.wait()
            for _ in range(steps):
                t(torch.tensor([k, 10 + k, k])).sum().backward()
                t.step()
        except Exception as exc:  # noqa: BLE001 - returned to the test
            errors.append(f"{type(exc).__name__}: {exc}")

    workers = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return {"errors": errors, "rows": t.state_dict()["weight"]}


class Tied(nn.Module):
    """One table used in two places (users and items share it), under two names."""

    def __init__(self, emb: nn.Module) -> None:
        super().__init__()
        self.users = emb
        self.items = emb
        torch.manual_seed(0)
        self.head = nn.Linear(3, 1)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        return self.head(self.users(users) * self.items(items)).squeeze(1)


TIED_BATCHES = [(torch.tensor([1, 15, 2]), torch.tensor([15, 3, 2])), (torch.tensor([4, 4, 16]), torch.tensor([16, 1, 5]))]


def tied_train(model: nn.Module, step: Callable[[], None], zero_grad: Callable[[], None]) -> None:
    for users, items in TIED_BATCHES:
        zero_grad()
        model(users, items).pow(2).sum().backward()
        step()


def tied_in_psmodel(name: str) -> dict:
    from remote_module.ps import PSModel

    model = PSModel(Tied(table(name + "-table")), ["ps2"], name=name, num_trainers=1, mode="async",
                    optimizer=(torch.optim.SGD, {"lr": 1.0}))
    tied_train(model, model.step, model.zero_grad)
    return dict(model.state_dict())


def train_while_loaded(name: str, steps: int) -> dict:
    """trainer1: ``steps`` async steps on rows 2 and 12 (while trainer0 loads a checkpoint)."""
    t = table(name, ps_mode="async", num_trainers=2, seed=None)
    for _ in range(steps):
        t(torch.tensor([2, 12])).sum().backward()
        t.step()
    return {"steps": steps}


def load_while_trained(name: str, times: int) -> dict:
    """trainer0: load weights(3) ``times`` times into the table trainer1 trains; the rows after."""
    t = table(name, ps_mode="async", num_trainers=2, seed=None)
    for _ in range(times):
        t.load_state_dict({"weight": weights(3)})
    return {"rows": t.state_dict()["weight"]}


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
        "mean huge bag": ("mean", (huge, torch.tensor([0, 1]))),
        "mean empty bags": ("mean", (torch.tensor([1, 15]), torch.tensor([0, 0, 2]))),
        "max huge bag": ("max", (huge, torch.tensor([0]))),
        "max empty bags": ("max", (torch.tensor([1, 15]), torch.tensor([0, 2, 2]))),
        "max padding -1 only": ("max-pad", (torch.tensor([[19, 19], [1, 19]]),)),
        "psw short": ("sum", (torch.tensor([9, 10, 10]), torch.tensor([0, 1]), torch.tensor([0.5, 2.0]))),
        "psw float64": ("sum", (torch.tensor([9, 10]), torch.tensor([0]), torch.tensor([0.5, 2.0], dtype=torch.float64))),
        "psw with mean": ("mean", (torch.tensor([9, 10]), torch.tensor([0]), torch.tensor([0.5, 2.0]))),
        "offsets not from 0": ("sum", (torch.tensor([9, 10]), torch.tensor([1]))),
        "offsets past the end": ("sum", (torch.tensor([9, 10]), torch.tensor([0, 3]))),
        "offsets decreasing": ("sum", (torch.tensor([9, 10, 11, 12]), torch.tensor([0, 3, 1]))),
    }


def odd_modules(name: str | None) -> dict:
    """The modules odd_inputs() name: sharded (``name``) or, with None, local ones."""
    w = weights(0)
    if name is None:
        local = {"emb": nn.Embedding(20, 3, _weight=w.clone()), "pad": nn.Embedding(20, 3, padding_idx=-1, _weight=w.clone())}
        local.update({m: nn.EmbeddingBag(20, 3, mode=m, _weight=w.clone()) for m in ("sum", "mean", "max")})
        local["max-pad"] = nn.EmbeddingBag(20, 3, mode="max", padding_idx=-1, _weight=w.clone())
        with torch.no_grad():
            local["pad"].weight[19] = 0  # as nn.Embedding's own init zeroes it
        return local
    out = {"emb": table(f"{name}-emb", keep=False), "pad": table(f"{name}-pad", padding_idx=-1, keep=False)}
    out.update({m: table(f"{name}-{m}", bag=m, keep=False) for m in ("sum", "mean", "max")})
    out["max-pad"] = table(f"{name}-max-pad", bag="max", padding_idx=-1, keep=False)
    return out


def odd_lookups(name: str | None) -> dict:
    """Each of odd_inputs() on odd_modules(name): the output and the stepped gradient's rows, or
    the refusal's type and message."""
    modules = odd_modules(name)
    out = {}
    for case, (kind, args) in odd_inputs().items():
        module = modules[kind]
        try:
            got = module(*args)
        except Exception as exc:  # noqa: BLE001 - compared with torch's
            out[case] = (type(exc).__name__, str(exc).split("\n")[0])
            continue
        out[case] = (got.dtype, got.detach())
    return out


def never_stepped(name: str) -> dict:
    """The optimizer state of a table never stepped, loaded into another one that then trains."""
    t = table(name, optimizer=(torch.optim.Adagrad, {"lr": 0.5}))
    state = t.optimizer_state_dict()
    again = table(name + "-again", optimizer=(torch.optim.Adagrad, {"lr": 0.5}))
    again.load_optimizer_state_dict(state)
    train_steps(again, [[1, 15]], again.step)
    return {"state": state, "rows": again.state_dict()["weight"]}


def shutdown_during_lookups(name: str, path: str) -> bool:
    """Threads looking up table ``name`` while this trainer's RPC agent is shut down (not
    gracefully: the servers of these worlds wait in their own shutdown); each thread's last
    outcome is written to ``path`` as JSON once all have ended (or 10 s passed)."""
    import json

    import torch.distributed.rpc as rpc

    t = table(name, servers=["ps0"], rows=200, seed=None)
    outcomes: dict[int, dict] = {}
    started = threading.Barrier(4)

    def look(k: int) -> None:
        started.wait()
        while True:
            outcome = attempt(lambda: t(torch.arange(200)).shape)
            if not outcome["ok"]:
                outcomes[k] = outcome
                return

    def run() -> None:
        threads = [threading.Thread(target=look, args=(k,), daemon=True) for k in range(3)]
        for th in threads:
            th.start()
        started.wait()
        time.sleep(0.2)
        rpc.shutdown(graceful=False)
        for th in threads:
            th.join(timeout=10)
        with open(path + ".tmp", "w") as f:
            json.dump({"ended": [not th.is_alive() for th in threads], "outcomes": list(outcomes.values())}, f)
        import os

        os.replace(path + ".tmp", path)

    threading.Thread(target=run, daemon=True).start()
    return True
