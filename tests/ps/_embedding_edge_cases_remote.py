"""What tests/ps/test_embedding_edge_cases.py runs on its trainers: sharded tables used as an
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
    in two blocks, loaded with ``weights(seed)`` unless ``seed`` is None (every row, lazy too)."""
    from remote_module.ps import ShardedEmbedding, ShardedEmbeddingBag

    kwargs.setdefault("min_block_size", 1)
    kwargs.setdefault("optimizer", (torch.optim.SGD, {"lr": 1.0}))
    servers = kwargs.pop("servers", SERVERS)
    if bag is None:
        t = ShardedEmbedding(rows, dim, servers, name=name, **kwargs)
    else:
        t = ShardedEmbeddingBag(rows, dim, servers, name=name, mode=bag, **kwargs)
    if seed is not None and kwargs.get("init") == "lazy":
        t.load_state_dict({"weight.ids": torch.arange(rows), "weight.rows": weights(seed, rows, dim)})
    elif seed is not None:
        t.load_state_dict({"weight": weights(seed, rows, dim)})
    if keep:
        _objects[name] = t
    return t


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
    model = PSModel(nn.Sequential(t, nn.Linear(3, 1)), ["ps2"], name=name, num_trainers=1, ps_mode="async",
                    optimizer=(torch.optim.SGD, {"lr": 1.0}))
    idioms(model, model.step, model.zero_grad)
    return dict(model.state_dict())


def graph_leaf(out: torch.Tensor) -> Any:
    """The node of ``out``'s autograd graph that records the looked-up rows' gradient for the
    table's step (it holds the lookup's ids)."""
    fn = out.grad_fn
    while type(fn).__name__ != "_RowsForStepBackward":
        fn = next(f for f, _ in fn.next_functions if f is not None)
    return fn


def dropped_lookup_is_freed(name: str) -> dict:
    """A lookup whose output is dropped without backward (an eval loop without no_grad) leaves
    nothing behind: its rows (the leaf of the output's graph) are freed with the output."""
    import gc
    import weakref

    t = table(name)
    alive = []
    for _ in range(3):
        out = t(torch.tensor([1, 15]))
        leaf = graph_leaf(out)  # what records the rows the output was indexed from
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


def local_embedding(optimizer: tuple) -> tuple[nn.Embedding, torch.optim.Optimizer]:
    """The local reference: an nn.Embedding(sparse=True) with weights(0) and ``optimizer``."""
    emb = nn.Embedding(20, 3, sparse=True, _weight=weights(0))
    return emb, optimizer[0](emb.parameters(), **optimizer[1])


def local_steps(optimizer: tuple, steps: list[list[int]]) -> tuple[nn.Embedding, torch.optim.Optimizer]:
    """local_embedding() trained on ``steps`` as train_steps() trains a table."""
    emb, opt = local_embedding(optimizer)
    train_steps(emb, steps, lambda: (opt.step(), opt.zero_grad()))
    return emb, opt


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
    from remote_module.ps.tables.server import _handlers

    return _handlers._table(name).memory_bytes()


def big_tables(name: str) -> dict:
    """An eager and a lazy 1,000,000 x 16 table with SparseAdam; the lazy one trained on 1,000
    rows: what each server holds after creation and after the step."""
    eager = table(name + "-eager", rows=1_000_000, dim=16, seed=None, optimizer=(torch.optim.SparseAdam, {"lr": 0.1}))
    lazy = table(name + "-lazy", rows=1_000_000, dim=16, seed=None, init="lazy",
                 optimizer=(torch.optim.SparseAdam, {"lr": 0.1}))
    ids = torch.randperm(1_000_000, generator=torch.Generator().manual_seed(0))[:1000]
    lazy(ids).sum().backward()
    lazy.step()
    lazy.flush()  # (the step returns with its pushes in flight: landed here, before the servers are measured)
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


TIED_BATCHES = [
    (torch.tensor([1, 15, 2]), torch.tensor([15, 3, 2])),
    (torch.tensor([4, 4, 16]), torch.tensor([16, 1, 5])),
]


def tied_train(model: nn.Module, step: Callable[[], None], zero_grad: Callable[[], None]) -> None:
    for users, items in TIED_BATCHES:
        zero_grad()
        model(users, items).pow(2).sum().backward()
        step()


def tied_in_psmodel(name: str) -> dict:
    from remote_module.ps import PSModel

    model = PSModel(Tied(table(name + "-table")), ["ps2"], name=name, num_trainers=1, ps_mode="async",
                    optimizer=(torch.optim.SGD, {"lr": 1.0}))
    tied_train(model, model.step, model.zero_grad)
    return dict(model.state_dict())


def train_while_loaded(name: str, steps: int) -> dict:
    """trainer1: ``steps`` async steps on rows 2 and 12 (while trainer0 loads a checkpoint)."""
    t = table(name, ps_mode="async", num_trainers=2, seed=None)
    for _ in range(steps):
        t(torch.tensor([2, 12])).sum().backward()
        t.step()
    t.flush()  # (the last step's pushes landed before returning)
    return {"steps": steps}


def load_while_trained(name: str, times: int) -> dict:
    """trainer0: load weights(3) ``times`` times into the table trainer1 trains; the rows after."""
    t = table(name, ps_mode="async", num_trainers=2, seed=None)
    for _ in range(times):
        t.load_state_dict({"weight": weights(3)})
    return {"rows": t.state_dict()["weight"]}


def never_stepped(name: str) -> dict:
    """The optimizer state of a table never stepped, loaded into another one that then trains."""
    t = table(name, optimizer=(torch.optim.Adagrad, {"lr": 0.5}))
    state = t.optimizer_state_dict()
    again = table(name + "-again", optimizer=(torch.optim.Adagrad, {"lr": 0.5}))
    again.load_optimizer_state_dict(state)
    train_steps(again, [[1, 15]], again.step)
    return {"state": state, "rows": again.state_dict()["weight"]}


def copies(name: str) -> dict:
    """copy.deepcopy and a pickle round trip of a table with a gradient not pushed yet: the
    copies look up the same rows; the original still steps its own gradient (once)."""
    import copy
    import pickle

    t = table(name)
    ids = torch.tensor([1, 15])
    t(ids).sum().backward()
    deep, unpickled = copy.deepcopy(t), pickle.loads(pickle.dumps(t))
    deep.step()  # nothing to push: the gradient stays the original's
    t.step()
    return {"original": t(ids).detach(), "deep": deep(ids).detach(), "unpickled": unpickled(ids).detach()}


def deferred_init(name: str) -> dict:
    """A model holding a table over two servers in several blocks, moved to the meta device and
    back with ``to_empty()`` (deferred initialisation, as torchrec and FSDP users write it):
    lookups before and after, and after a step (lr 1, gradient 1 a position)."""
    t = table(name, bag="sum")
    model = nn.Sequential(t)
    ids, offsets = torch.tensor([1, 15, 9, 19, 0]), torch.tensor([0, 2])
    with torch.no_grad():
        before = t(ids, offsets)
    model.to("meta")
    model.to_empty(device="cpu")
    with torch.no_grad():
        after = t(ids, offsets)
    t(ids, offsets).sum().backward()
    t.step()
    return {"before": before, "after": after, "rows": t.state_dict()["weight"]}


def saved_whole(name: str) -> dict:
    """``torch.save`` of a model holding a table (a "best model" file) warns that the rows are
    not in it; ``copy.deepcopy`` and ``pickle`` (copies sharing the rows, as documented) do not.
    The warnings caught for each, and the files they point at."""
    import copy
    import io
    import pickle
    import warnings

    model = nn.Sequential(table(name, bag="sum"), nn.Linear(3, 1))
    got = {}
    for what, run in (("torch.save", lambda: torch.save(model, io.BytesIO())),
                      ("legacy torch.save",
                       lambda: torch.save(model, io.BytesIO(), _use_new_zipfile_serialization=False)),
                      ("deepcopy", lambda: copy.deepcopy(model)), ("pickle", lambda: pickle.dumps(model))):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
        got[what] = [(str(w.message), w.filename) for w in caught]
    return got


# ---- a ported model's constructor calls and print(model) --------------------------------------------------


def ported_constructors(name: str) -> dict:
    """Tables built as a port of ``nn.EmbeddingBag(n, m, mode="sum", sparse=True)`` writes them
    (facebookresearch/dlrm: numpy sizes, ``sparse=True``), and their reprs."""
    import numpy as np

    bag = table(f"{name}-bag", np.int64(20), np.int64(3), bag="sum", sparse=True)
    emb = table(f"{name}-emb", sparse=False, padding_idx=2)
    ids = torch.tensor([1, 15, 4])
    before = bag(ids, torch.tensor([0, 1])).detach()
    bag(ids, torch.tensor([0, 1])).sum().backward()
    bag.step()
    return {"bag": repr(bag), "emb": repr(emb), "sparse": (bag.sparse, emb.sparse),
            "moved": bag(ids, torch.tensor([0, 1])).detach() - before}


# ---- a bag table reusing its last lookup's bags ---------------------------------------------------

#: (ids, offsets, what the caller does to those offsets after the lookup): lookups with the same
#: bags as the last one (which a table reuses), offsets changed in place by the caller, offsets
#: that decrease (refused), the same offsets over more ids, 2-d inputs of two shapes
SAME_BAGS_SEQUENCE = [
    ([1, 2, 4, 5, 4, 19], [0, 2, 4]),
    ([3, 3, 0, 7, 11, 12], "the last offsets, changed in place"),
    ([1, 2, 4, 5, 4, 19], [0, 2, 4]),
    ([1, 2, 4, 5, 4, 19], [0, 2, 4]),
    ([3, 3, 0, 7, 11, 12], [0, 4, 2]),
    ([6, 6, 6, 8, 9, 10, 0, 1], [0, 3, 4]),
    ([[1, 2], [3, 4], [5, 6], [7, 8]], None),
    ([[2, 2], [3, 3], [9, 9], [1, 0]], None),
    ([[1, 2, 3, 4], [5, 6, 7, 8]], None),
]


def same_bags_lookups(bag: nn.Module, step: Callable[[], None]) -> list:
    """``SAME_BAGS_SEQUENCE``'s lookups on ``bag`` (sum pooling), each trained with a loss that
    weighs every output element differently and ``step()``; per lookup its output, or the
    exception's type when it raised."""
    out, last = [], None
    for k, (ids, offsets) in enumerate(SAME_BAGS_SEQUENCE):
        if isinstance(offsets, str):
            last[1] = 3  # (the caller's tensor: the table must not keep reading it)
            offsets = last
        elif offsets is not None:
            offsets = torch.tensor(offsets)
        try:
            pooled = bag(torch.tensor(ids), offsets)
        except (ValueError, RuntimeError) as exc:
            out.append(type(exc).__name__)
            continue
        weights = torch.arange(pooled.numel(), dtype=pooled.dtype).reshape(pooled.shape) / 10 + k
        (pooled * weights).sum().backward()
        step()
        out.append(pooled.detach())
        last = offsets
    return out


def same_bags_sharded(name: str, servers: list[str]) -> dict:
    t = table(name, bag="sum", servers=servers)
    got = same_bags_lookups(t, t.step)
    return {"outputs": got, "weight": t.state_dict()["weight"]}


def pickled_sizes_around_a_lookup(name: str, servers: list[str], n: int) -> dict:
    """The pickled size of a sum bag table before and after a lookup of ``n`` ids (with grad,
    then without), and the outputs of that lookup on a deep copy and an unpickled copy."""
    import copy
    import pickle

    t = table(name, rows=1000, bag="sum", servers=servers)
    ids, offsets = torch.arange(n) % 1000, torch.arange(0, n, 4)
    before = len(pickle.dumps(t))
    t(ids, offsets).sum().backward()
    t.zero_grad()
    with torch.no_grad():
        out = t(ids, offsets)
    after = len(pickle.dumps(t))
    copies = [copy.deepcopy(t)(ids, offsets).detach(), pickle.loads(pickle.dumps(t))(ids, offsets).detach()]
    t.zero_grad()
    return {"before": before, "after": after, "out": out, "copies": copies}


# ---- a lookup's gradient pushed as its bags' gradient ---------------------------------------------

#: steps of ``bags_form_steps``: each a list of lookups ``(ids, offsets)`` trained before one step
BAGS_FORM_STEPS = [
    [([1, 2, 4, 5, 4, 19], [0, 2, 2, 4])],  # an empty bag; ids on both servers
    [([1, 2, 3, 1], [0, 1])],  # ids on ps0 only: ps1 gets an empty push
    [([11, 12, 11, 0], [0, 3]), ([5, 11, 5], [0, 1])],  # two lookups, one step: the rows' form
    [([[3, 13], [13, 3], [0, 0]], None)],  # 2-d input
]


def bags_form_steps(bag: nn.Module, step: Callable[[], None]) -> list[int]:
    """``BAGS_FORM_STEPS`` on ``bag``, each lookup's output weighed differently in the loss; the
    bytes each step pushed (a sharded table's ``_pushed_bytes``, 0 for a local module)."""
    pushed = []
    for k, lookups in enumerate(BAGS_FORM_STEPS):
        before = getattr(bag, "_pushed_bytes", 0)
        for j, (ids, offsets) in enumerate(lookups):
            pooled = bag(torch.tensor(ids), None if offsets is None else torch.tensor(offsets))
            weights = torch.arange(pooled.numel(), dtype=pooled.dtype).reshape(pooled.shape) / 7 - k + j
            (pooled * weights).sum().backward()
        step()
        getattr(bag, "flush", lambda: None)()
        pushed.append(getattr(bag, "_pushed_bytes", 0) - before)
    return pushed


def bags_form_sharded(name: str, mode: str) -> dict:
    t = table(name, bag=mode)
    pushed = bags_form_steps(t, t.step)
    return {"pushed": pushed, "weight": t.state_dict()["weight"]}


def bags_form_given_gradient(bag: nn.Module, step: Callable[[], None]) -> None:
    """A lookup backpropagated from a gradient tensor the caller owns (``out.backward(g)``: a
    pipeline stage's received gradient), which it refills before the step (the buffer reused),
    then a second lookup and backward from it before one step."""
    g = torch.empty(3, 3)
    for k, (ids, offsets) in enumerate([([1, 2, 4, 5, 4, 19], [0, 2, 4]), ([3, 13, 3, 0, 7, 11], [0, 1, 5])]):
        out = bag(torch.tensor(ids), torch.tensor(offsets))
        g.copy_(torch.arange(9.0).reshape(3, 3) / 3 - k)
        out.backward(g)
        g.zero_()
        if k == 0:
            step()


def bags_form_given_gradient_sharded(name: str, mode: str) -> torch.Tensor:
    t = table(name, bag=mode)
    bags_form_given_gradient(t, t.step)
    t.step()
    t.flush()
    return t.state_dict()["weight"]


def ids_changed_before_step(name: str, servers: int) -> torch.Tensor:
    """A sum bag table of more than 2**31 rows (ids travel as int64) on ``servers`` servers,
    rows 0-9 loaded with ones: a lookup of ids 5, 6, 7 backpropagated, the caller's id tensor
    then filled with 9 (a reused batch buffer) before ``step()``; rows 0-9 after."""
    from remote_module.ps import ShardedEmbeddingBag

    t = ShardedEmbeddingBag(2**31 + 10, 2, SERVERS[:servers], name=name, mode="sum", init="lazy",
                            optimizer=(torch.optim.SGD, {"lr": 1.0}))
    t.load_state_dict({"weight.ids": torch.arange(10), "weight.rows": torch.ones(10, 2)})
    ids = torch.tensor([5, 6, 7])
    t(ids, torch.tensor([0, 2])).sum().backward()
    ids.fill_(9)
    t.step()
    return t.state_dict()["weight.rows"]
