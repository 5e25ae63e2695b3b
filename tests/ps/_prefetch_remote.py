"""What tests/ps/test_prefetch.py runs on its trainers: tables and collections trained with and
without prefetch (and with steps left in flight), returning their outputs, rows and the
messages they sent, which pytest compares."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from tests._deadlines import HANG_S
from tests.benchmarks._common import messages_per_call
from tests.ps._embedding_edge_cases_remote import _objects, attempt, table, weights

ROWS, DIM = 20, 3


def batches(seed: int, steps: int, bags: int = 3, per_bag: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of ``bags`` bags (1-d ids, offsets; bag sizes vary, one may be empty),
    ids over both servers' rows (0-9 on ps0, 10-19 on ps1), from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        sizes = torch.randint(0, per_bag + 1, (bags,), generator=g)
        sizes[0] = max(int(sizes[0]), 2)
        ids = torch.randint(0, ROWS, (int(sizes.sum()),), generator=g)
        ids[0], ids[1] = 1, 15  # both servers, every step
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)[:-1]])
        out.append((ids, offsets))
    return out


def target(batch: tuple, dim: int = DIM) -> torch.Tensor:
    return torch.full((batch[1].numel(), dim), 0.5)


def _loop(model: Any, data: list, forward: Any, step: Any, prefetch: Any, overlap: bool = False) -> list[torch.Tensor]:
    from remote_module.ps import prefetching

    outs = []
    source = prefetching(data, model, features=prefetch, overlap=overlap) if prefetch is not None else data
    for batch in source:
        out = forward(batch)
        value = out if isinstance(out, torch.Tensor) else torch.cat([out[k] for k in sorted(out)], 1)
        outs.append(value.detach().clone())
        ((value - 0.5) ** 2).sum().backward()
        step()
    return outs


def train_bag(name: str, mode: str, prefetched: bool, steps: int = 6, seed: int = 1, bag: str = "sum",
              overlap: bool = False, **kwargs: Any) -> dict:
    """A bag table trained ``steps`` steps in ``mode``, with ``prefetching`` or without: each
    step's output, the rows after, and the messages sent to each server over the loop."""
    t = table(name, bag=bag, ps_mode=mode, half_async_merge_every=1, half_async_merge_s=3600.0, geo_push_every=2,
              **kwargs)
    data = batches(seed, steps)
    outs: list = []

    def run() -> None:
        outs.extend(_loop(t, data, lambda b: t(b[0], b[1]), t.step, (lambda b: b) if prefetched else None, overlap))

    messages = messages_per_call(run, 1)
    t.flush()
    return {"outs": outs, "rows": t.state_dict()["weight"], "messages": messages}


def overlap_refused(name: str) -> dict:
    from remote_module.ps import prefetching

    t = table(name, bag="sum", ps_mode="sync")
    return attempt(lambda: next(prefetching([torch.tensor([[1, 15]])], t, overlap=True)))


def train_embedding(name: str, mode: str, prefetched: bool, steps: int = 6, seed: int = 2) -> dict:
    """A ShardedEmbedding trained with or without ``prefetching``."""
    t = table(name, ps_mode=mode, half_async_merge_every=1, half_async_merge_s=3600.0, geo_push_every=2)
    data = [torch.cat([ids, ids])[:4].reshape(2, 2) for ids, _ in batches(seed, steps, bags=2, per_bag=4)]
    outs = _loop(t, data, t, t.step, (lambda b: b) if prefetched else None)
    t.flush()
    return {"outs": outs, "rows": t.state_dict()["weight"]}


def collection(name: str, mode: str, **kwargs: Any) -> Any:
    """A collection of a sum and a mean bag (planned together), a max bag and a bag with a
    padding row (each planned alone), over ps0 and ps1."""
    from remote_module.ps import ShardedEmbeddingBagCollection

    common = {"ps_mode": mode, "half_async_merge_every": 1, "half_async_merge_s": 3600.0, "geo_push_every": 2,
              "keep": False, **kwargs}
    return ShardedEmbeddingBagCollection({
        "s": table(f"{name}-s", bag="sum", **common),
        "m": table(f"{name}-m", bag="mean", **common),
        "x": table(f"{name}-x", bag="max", **common),
        "p": table(f"{name}-p", bag="sum", padding_idx=3, **common),
    })


def train_collection(name: str, mode: str, prefetched: bool, steps: int = 5, seed: int = 3) -> dict:
    ebc = collection(name, mode)
    data = [{k: batches(seed + i, steps)[j] for i, k in enumerate("smxp")} for j in range(steps)]
    outs: list = []

    def run() -> None:
        outs.extend(_loop(ebc, data, ebc, ebc.step, (lambda b: b) if prefetched else None))

    messages = messages_per_call(run, 1)
    ebc.flush()
    return {"outs": outs, "rows": {k: v for k, v in ebc.state_dict().items()}, "messages": messages}


def sync_pair(name: str, prefetched: bool, rank: int, steps: int = 5) -> dict:
    """One of two trainers of a sync bag, each on its own batches."""
    t = table(name, bag="mean", ps_mode="sync", num_trainers=2, seed=None)
    data = batches(10 + rank, steps)
    outs = _loop(t, data, lambda b: t(b[0], b[1]), t.step, (lambda b: b) if prefetched else None)
    return {"outs": outs, "rows": t.state_dict()["weight"]}


def load(name: str) -> bool:
    """Create the sync pair's table with ``weights(0)`` loaded, before its trainers use it."""
    table(name, bag="mean", ps_mode="sync", num_trainers=2, keep=False)
    return True


# ---- handles -----------------------------------------------------------------------------------------


def handles(name: str, mode: str) -> dict:
    """What a forward gets after prefetches that do not match it, and the errors a prefetch of
    bad arguments raises (beside the forward's)."""
    t = table(name, bag="sum", ps_mode=mode)
    a, b = torch.tensor([[1, 15], [2, 16]]), torch.tensor([[3, 17]])
    out: dict[str, Any] = {}
    with torch.no_grad():
        out["plain_b"] = t(b)
        t.prefetch(a)
        out["other"] = t(b)           # drops the prefetch of a
        out["after_drop"] = t(a)      # a fresh lookup of a
        t.prefetch(a)
        t.prefetch(b)                 # replaces it
        out["replaced"] = t(a)
        ids = a.clone()
        t.prefetch(ids)
        ids[0, 0] = 3                 # changed in place after the prefetch
        out["changed"] = t(ids)
        out["changed_plain"] = t(ids)
    bad = torch.tensor([[1, 99]])
    out["forward_error"] = attempt(lambda: t(bad))
    out["prefetch_error"] = attempt(lambda: t.prefetch(bad))
    out["offsets_error"] = attempt(lambda: t.prefetch(torch.tensor([1, 2]), torch.tensor([1, 0])))
    return out


def no_grad_then_grad(name: str) -> dict:
    """A prefetch made under no_grad is not consumed by a forward that records (and the
    gradient that forward records is pushed as without a prefetch)."""
    t = table(name, bag="sum", ps_mode="async")
    a = torch.tensor([[1, 15]])
    with torch.no_grad():
        t.prefetch(a)
    t(a).sum().backward()
    t.step()
    return {"rows": t.state_dict()["weight"]}


def in_flight(name: str, mode: str, what: str) -> dict:
    """A step left in flight, then ``what``: its rows (a checkpoint), a flush, a zero_grad, a
    load, or a forward (of the prefetched batch); what the servers hold after."""
    t = table(name, bag="sum", ps_mode=mode)
    a, b = torch.tensor([[1, 15], [2, 16]]), torch.tensor([[3, 17]])
    t(a).pow(2).sum().backward()
    t.prefetch(b)
    t.step()
    got: dict[str, Any] = {}
    if what == "state_dict":
        got["state"] = t.state_dict()["weight"]
    elif what == "flush":
        t.flush()
    elif what == "zero_grad":
        t.zero_grad()
    elif what == "load":
        t.load_state_dict({"weight": weights(5)})
        with torch.no_grad():
            got["after_load"] = t(b)
    elif what == "forward":
        with torch.enable_grad():
            got["out"] = t(b).detach()
    elif what == "optimizer_state_dict":
        got["state"] = t.optimizer_state_dict()
    got["rows"] = t.state_dict()["weight"]
    return got


def collection_load(name: str, mode: str, alone: bool) -> dict:
    """A collection's step sent with a prefetch, then a load (of the collection, or of one of
    its tables alone when ``alone``): the next forward of the prefetched features reads the
    loaded rows, not those the prefetch read before the load."""
    ebc = collection(name, mode)
    feats = {k: torch.tensor([[1, 15], [2, 16]]) for k in "smxp"}
    sum(v.sum() for v in ebc(feats).values()).backward()
    ebc.prefetch(feats)
    ebc.step()
    zeros = torch.zeros(ROWS, DIM)
    if alone:
        ebc["s"].load_state_dict({"weight": zeros})
    else:
        ebc.load_state_dict({f"{k}.weight": zeros for k in "smxp"})
    with torch.enable_grad():
        out = ebc(feats)
    return {k: v.detach() for k, v in out.items()}


def local_bag(mode: str = "sum", padding_idx: int | None = None, seed: int = 0) -> nn.EmbeddingBag:
    return nn.EmbeddingBag(ROWS, DIM, mode=mode, sparse=True, padding_idx=padding_idx, _weight=weights(seed))


# ---- faults -------------------------------------------------------------------------------------------


def prepare_in_flight(name: str, mode: str) -> bool:
    """A table (rows on ps0 and ps1) with a backward done and the next batch prefetched (no
    timeout of its own: the test sets the one it tests once the fault holds)."""
    t = table(name, bag="sum", ps_mode=mode)
    t(torch.tensor([[1, 15]])).pow(2).sum().backward()
    t.prefetch(torch.tensor([[2, 16]]))
    return True


def on_table(name: str, what: str) -> dict:
    """``what`` on table ``name``: "step" (returns with its pushes in flight: ``in_flight`` says
    whether they were still to be landed when it returned), "forward" (of the prefetched batch,
    with backward), "retry" (step), "train" (a plain step), "rows", "owners" (each row's server)."""
    t = _objects[name]
    ids = torch.tensor([[2, 16]])
    return _in_flight_after(t, what, attempt({
        "step": t.step,
        "forward": lambda: t(ids).pow(2).sum().backward(),
        "train": lambda: (t(ids).pow(2).sum().backward(), t.step(), t.flush()),
        "rows": lambda: t.state_dict()["weight"],
        "owners": lambda: [t._server_names[int(k)] for k in t._server_of(torch.arange(ROWS))],
    }[what]))


def _in_flight_after(owner: Any, what: str, outcome: dict) -> dict:
    """``outcome``, and for a "step" whether ``owner`` (a table, a PSModel) still held that
    step's pushes in flight, not landed, when it returned: true only for a step() that did not
    wait for their answers (a server frozen meanwhile: had it waited, it would have failed)."""
    if what == "step":
        outcome["in_flight"] = owner.__dict__.get("_flight") is not None
    return outcome


def zero_grad_prepare(name: str) -> bool:
    """A collection of two plain sum bags (async, rows on ps0 and ps1) trained through
    ``prefetching(overlap=True)`` with a local optimizer of its parameters (the grad markers,
    as an optimizer of ``model.parameters()`` holds them) zeroed before each forward: two steps,
    landed (no timeout of its own: the test sets the one it tests once the fault holds)."""
    from remote_module.ps import ShardedEmbeddingBagCollection, prefetching

    ebc = ShardedEmbeddingBagCollection({k: table(f"{name}-{k}", bag="sum", ps_mode="async", keep=False)
                                         for k in "ab"})
    opt = torch.optim.SGD(ebc.parameters(), lr=0.1)
    data = [{"a": torch.tensor([[1, 15], [i, 10 + i]]), "b": torch.tensor([[2, 16, i]])} for i in range(8)]
    _objects[name] = (ebc, opt, iter(prefetching(data, ebc, overlap=True)), data)
    for _ in range(2):
        zero_grad_do(name, "train")
    ebc.flush()  # (answered before ps1 is stopped)
    return True


def zero_grad_do(name: str, what: str) -> dict:
    """``what`` on ``zero_grad_prepare``'s loop: "train" (an iteration: zero_grad, forward,
    backward, step), "eval" (the optimizer's zero_grad, then a forward under no_grad), "retry"
    (step, flush); with the rows each pushed."""
    ebc, opt, batches_left, data = _objects[name]

    def train() -> None:
        batch = next(batches_left)
        opt.zero_grad()
        sum(v.pow(2).sum() for v in ebc(batch).values()).backward()
        ebc.step()

    def evaluate() -> None:
        opt.zero_grad()
        with torch.no_grad():
            ebc(data[0])

    before = sum(v["rows_pushed"] for v in ebc.traffic.values())
    out = attempt({"train": train, "eval": evaluate, "retry": lambda: (ebc.step(), ebc.flush())}[what])
    out["pushed"] = sum(v["rows_pushed"] for v in ebc.traffic.values()) - before
    return out


# ---- what the hostile review found ---------------------------------------------------------------------


def between(name: str, mode: str, what: str, prefetched: bool) -> torch.Tensor:
    """A step (with the next lookup prefetched, or not), then ``what`` ("flush", "state_dict",
    "double"), then the forward of that lookup: its output."""
    t = table(name, bag="sum", ps_mode=mode, half_async_merge_every=100, half_async_merge_s=3600.0)
    a, b = torch.tensor([[1, 15], [2, 16]]), torch.tensor([[1, 16]])
    t(a).pow(2).sum().backward()
    if prefetched:
        t.prefetch(b)
    t.step()
    if what == "flush":
        t.flush()
    elif what == "state_dict":
        t.state_dict()
    elif what == "double":
        t.double()
    return t(b).detach()


def weights_grad(name: str, prefetched: bool) -> dict:
    """per_sample_weights that need a gradient, after a prefetch of equal (plain) weights: the
    forward's own weights get it."""
    t = table(name, bag="sum", ps_mode="async")
    ids, offsets = torch.tensor([1, 15, 2, 16]), torch.tensor([0, 2])
    w = torch.tensor([0.5, 2.0, 1.0, -1.0])
    if prefetched:
        t.prefetch(ids, offsets, w.clone())
    mine = w.clone().requires_grad_()
    t(ids, offsets, mine).pow(2).sum().backward()
    return {"grad": mine.grad}


def unfrozen(name: str, prefetched: bool) -> dict:
    """A collection table frozen at the prefetch and unfrozen before the forward trains."""
    ebc = collection(name, "async")
    feats = {k: torch.tensor([[1, 15]]) for k in "smxp"}
    ebc["s"].requires_grad_(False)
    if prefetched:
        ebc.prefetch(feats)
    ebc["s"].requires_grad_(True)
    sum(v.sum() for v in ebc(feats).values()).backward()
    ebc.step()
    return {k: v.clone() for k, v in ebc.state_dict().items()}


def failing_loader(name: str, prefetched: bool) -> dict:
    """A loader that yields two batches and then raises: both train, then its error."""
    from remote_module.ps import prefetching

    t = table(name, bag="sum", ps_mode="async")

    def loader():
        yield torch.tensor([[1, 15]])
        yield torch.tensor([[2, 16]])
        raise OSError("the loader broke")

    trained, error = 0, None
    try:
        for ids in (prefetching(loader(), t) if prefetched else loader()):
            t(ids).sum().backward()
            t.step()
            trained += 1
    except OSError as exc:
        error = str(exc)
    t.pushed_bytes = 0  # assignable, to reset it
    return {"trained": trained, "error": error, "rows": t.state_dict()["weight"], "reset": t.pushed_bytes}


#: the timeout trainer0's prefetched lookup is expected to reach (trainer1 late)
LATE_TIMEOUT = 2.0


def sync_late_attach(name: str) -> bool:
    table(name, bag="sum", ps_mode="sync", num_trainers=2, timeout=HANG_S)  # (calls that must not time out)
    return True


def sync_late(name: str, what: str) -> dict:
    """Two sync trainers, trainer1 late: trainer0's prefetched lookup times out waiting for it
    (raised by a lookup, as without prefetch, and not a push failure: its push went through);
    once trainer1 steps, trainer0's next forward works and the two stay in step."""
    t = _objects[name]
    ids = torch.tensor([[1, 15]])
    if what == "first":
        t(ids).sum().backward()
        t.timeout = LATE_TIMEOUT  # the prefetch, sent with the step, and the lookup that takes it
        try:
            t.prefetch(ids)
            t.step()
            return attempt(lambda: t(ids).detach())
        finally:
            t.timeout = HANG_S
    if what == "step":  # (trainer1)
        return attempt(lambda: (t(ids).sum().backward(), t.step()))
    return attempt(lambda: (t(ids).sum().backward(), t.step(), t.state_dict()["weight"])[2])


def mixed(name: str, prefetched: bool, steps: int = 5) -> dict:
    """A table prefetched on its own (prefetching) and also stepped through a collection that
    holds it, every iteration: the pushes made through the collection count for the table's
    prefetches (a prefetch that would miss one is not used)."""
    from remote_module.ps import prefetching

    ebc = collection(name, "async")
    t = ebc["s"]
    data = [torch.cat([ids[:2], ids[-1:]]).reshape(1, 3) for ids, _ in batches(7, steps)]  # (rows 1, 15 every time)
    outs = []
    for ids in (prefetching(data, t) if prefetched else data):
        out = t(ids)
        outs.append(out.detach().clone())
        out.pow(2).sum().backward()
        t.step()
        sum(v.sum() for v in ebc({k: ids for k in "smxp"}).values()).backward()  # (the same rows of t)
        ebc.step()
    ebc.flush()
    return {"outs": outs, "rows": t.state_dict()["weight"]}


def batches_held(name: str, steps: int = 12) -> int:
    """``prefetching(overlap=True)`` over batches made one at a time, evaluated under no_grad
    without a step (an epoch function shared by training and evaluation, say): the most of them
    alive at once."""
    import weakref

    from remote_module.ps import prefetching

    t = table(name, bag="sum", ps_mode="async")
    made: list = []

    def loader():
        for i in range(steps):
            ids = torch.tensor([[1, 15], [i % 10, 19 - i % 10]])
            made.append(weakref.ref(ids))
            yield ids

    most = 0
    with torch.no_grad():
        for ids in prefetching(loader(), t, overlap=True):
            t(ids)
            most = max(most, sum(ref() is not None for ref in made))
    return most


def prefetches_kept(name: str, steps: int = 30) -> int:
    """``prefetching(overlap=True)`` given int32 ids while the model looks up int64 ones (it
    casts them): no prefetch matches a forward. The most prefetches the table kept at once."""
    from remote_module.ps import prefetching

    t = table(name, bag="sum", ps_mode="async")
    data = [torch.tensor([[1, 15], [i % 10, 19 - i % 10]], dtype=torch.int32) for i in range(steps)]
    most = 0
    for ids in prefetching(data, t, overlap=True):
        t(ids.long()).pow(2).sum().backward()
        t.step()
        most = max(most, len(t._prefetches.handles))
    return most


def load_in_loop(name: str, steps: int = 9, at: int = 3) -> dict:
    """A collection trained through ``prefetching(overlap=True)``, its own checkpoint loaded
    after step ``at``: the messages each step sent (both servers)."""
    from remote_module.ps import prefetching

    ebc = collection(name, "async")
    data = [{k: batches(3 + i, steps)[j] for i, k in enumerate("smxp")} for j in range(steps)]
    sent = []
    for k, batch in enumerate(prefetching(data, ebc, overlap=True)):
        before = sum(v["messages"] for v in ebc.traffic.values())
        out = ebc(batch)
        sum(((v - 0.5) ** 2).sum() for v in out.values()).backward()
        ebc.step()
        sent.append(sum(v["messages"] for v in ebc.traffic.values()) - before)
        if k == at:
            ebc.load_state_dict(ebc.state_dict())
    ebc.flush()
    return {"sent": sent}


# ---- a PSModel's step in flight -----------------------------------------------------------------------


def psmodel_prepare(name: str, mode: str = "async") -> bool:
    """A PSModel of a Linear(4, 2) over ps0 and ps1 (a block on each; geo: pushing every step),
    its gradients ready (no timeout of its own: the test sets the one it tests once the fault
    holds)."""
    from remote_module.ps import PSModel

    torch.manual_seed(0)
    ps = PSModel(nn.Linear(4, 2), ["ps0", "ps1"], name=name, ps_mode=mode, num_trainers=1,
                 min_block_size=1, geo_push_every=1,
                 optimizer=(torch.optim.SGD, {"lr": 0.1}))
    _objects[name] = ps
    ps(torch.ones(3, 4)).pow(2).sum().backward()
    return True


def psmodel_do(name: str, what: str) -> dict:
    """``what`` on PSModel ``name``: "step" (returns with its pushes in flight: ``in_flight`` as
    :func:`on_table`'s), "forward" (and backward), "grads" (whether the local gradients are
    set), "retry" (step, then flush), "ps0_vs_torch" (:func:`_ps0_vs_torch`)."""
    ps = _objects[name]
    return _in_flight_after(ps, what, attempt({
        "step": ps.step,
        "forward": lambda: ps(torch.ones(3, 4)).pow(2).sum().backward(),
        "grads": lambda: all(p.grad is not None for p in ps.module.parameters()),
        "retry": lambda: (ps.step(), ps.flush()),
        "ps0_vs_torch": lambda: _ps0_vs_torch(ps),
    }[what]))


def _ps0_vs_torch(ps: Any) -> float:
    """How far ps0's blocks are from torch's Linear after two SGD steps (of psmodel_prepare's
    model and batch): the servers' values read, nothing written."""
    from remote_module.ps._placement import block_of

    torch.manual_seed(0)
    ref = nn.Linear(4, 2)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        ref(torch.ones(3, 4)).pow(2).sum().backward()
        opt.step()
    values, params = ps._server_values(), dict(ref.named_parameters())
    return max(float((values[s.name].reshape(-1) - block_of(params[s.pname].detach(), s.block).reshape(-1)).abs().max())
               for s in ps._slots if s.server == "ps0")


def nested_eval(name: str, mode: str, overlap: bool, evaluated: str) -> dict:
    """A training loop over ``prefetching`` with, every other step, an evaluation under no_grad
    of two test batches (``evaluated``: ``"plain"`` batches, or their own ``prefetching`` on the
    same collection, left early as facebookresearch/dlrm's ``inference()`` leaves its loader at
    ``nbatches``): outputs, evaluation outputs, rows and the messages per server."""
    ebc = collection(name, mode)
    data = [{k: batches(3 + i, 6)[j] for i, k in enumerate("smxp")} for j in range(6)]
    tests = [{k: batches(30 + i, 3)[j] for i, k in enumerate("smxp")} for j in range(3)]
    outs: list = []
    evals: list = []

    def run() -> None:
        from remote_module.ps import prefetching

        for j, batch in enumerate(prefetching(data, ebc, features=lambda b: b, overlap=overlap)):
            out = ebc(batch)
            value = torch.cat([out[k] for k in sorted(out)], 1)
            outs.append(value.detach().clone())
            ebc.zero_grad()
            ((value - 0.5) ** 2).sum().backward()
            ebc.step()
            if j % 2 == 1:
                with torch.no_grad():  # (the loop over a temporary: left, it is closed, as in dlrm)
                    for i, test in enumerate(prefetching(tests, ebc, features=lambda b: b)
                                             if evaluated == "prefetched" else tests):
                        if i >= 2:
                            break
                        got = ebc(test)
                        evals.append(torch.cat([got[k] for k in sorted(got)], 1))

    messages = messages_per_call(run, 1)
    ebc.flush()
    return {"outs": outs, "evals": evals, "rows": {k: v for k, v in ebc.state_dict().items()},
            "messages": messages}


# ---- half_async merges between a prefetch and its forward (issue 41, item 2) ----------------------------


def _tables_of(t: Any) -> list:
    return list(t.tables().values()) if hasattr(t, "tables") else [t]


def _merges(t: Any) -> int:
    """The merges the servers of ``t`` (a table or a collection's tables) finished so far."""
    return sum(table.table_stats()["merges"] for table in _tables_of(t))


def wait_merges(t: Any, at_least: int, seconds: float = HANG_S) -> int:
    """Poll ``t``'s merge count until it reaches ``at_least`` (``AssertionError`` after
    ``seconds``, a guard against a hang, not a time limit); the count."""
    deadline = time.monotonic() + seconds
    while True:
        n = _merges(t)
        if n >= at_least:
            return n
        assert time.monotonic() < deadline, f"{n} merges after {seconds} s, waiting for {at_least}"
        time.sleep(0.01)


def timer_merges(name: str, prefetched: bool, overlap: bool = False, steps: int = 4,
                 collection_of: bool = False) -> dict:
    """A half_async bag (or collection) that merges only on its timer (``half_async_merge_s``):
    after each step, wait until the servers merged it (their merge count), so the prefetch sent
    with that step read the rows before the merge; then the next forward. Outputs, rows and the
    merge counts seen."""
    common = {"ps_mode": "half_async", "half_async_merge_every": 1000, "half_async_merge_s": 0.5}
    if collection_of:
        model = collection(name, "half_async", **{k: v for k, v in common.items() if k != "ps_mode"})
        data = [{k: batches(40 + i, steps)[j] for i, k in enumerate("smxp")} for j in range(steps)]
        forward = model
    else:
        model = table(name, bag="sum", keep=False, **common)
        data = batches(4, steps)
        forward = lambda b: model(b[0], b[1])  # noqa: E731
    from remote_module.ps import prefetching

    source = prefetching(data, model, features=lambda b: b, overlap=overlap) if prefetched else data
    outs, merges = [], []
    for k, batch in enumerate(source):
        out = forward(batch)
        value = out if isinstance(out, torch.Tensor) else torch.cat([out[n] for n in sorted(out)], 1)
        outs.append(value.detach().clone())
        ((value - 0.5) ** 2).sum().backward()
        model.step()
        # each step merges once on each server of each table (a server holding none of a step's
        # rows has an empty push queued: a step of the table all the same), on its timer
        merges.append(wait_merges(model, (k + 1) * sum(len(t._server_names) for t in _tables_of(model))))
    model.flush()
    rows = {k: v for k, v in model.state_dict().items()} if collection_of else model.state_dict()["weight"]
    return {"outs": outs, "rows": rows, "merges": merges}


def pair_start(name: str, rank: int, prefetched: bool, steps: int = 3) -> bool:
    """One of two half_async trainers of a bag that merges every 2 pushes (never on its timer):
    trainer0 creates it loaded, trainer1 attaches; each keeps its batch iterator (with or
    without ``prefetching``) for :func:`pair_step`."""
    from remote_module.ps import prefetching

    t = table(name, bag="sum", ps_mode="half_async", num_trainers=2, half_async_merge_every=2,
              half_async_merge_s=3600.0, seed=0 if rank == 0 else None, keep=False)
    data = batches(20 + rank, steps)
    source = prefetching(data, t, features=lambda b: b) if prefetched else data
    _objects[name] = (t, iter(source))
    return True


def pair_step(name: str) -> dict:
    """This trainer's next batch: forward, backward, step, and the step landed (its prefetch,
    if any, answered), so that the other trainer's push comes after it: the output and the
    merges the servers finished."""
    t, it = _objects[name]
    ids, offsets = next(it)
    out = t(ids, offsets)
    ((out - 0.5) ** 2).sum().backward()
    t.step()
    return {"out": out.detach().clone(), "merges": _merges(t)}


def pair_rows(name: str) -> torch.Tensor:
    t, _ = _objects.pop(name)
    t.flush()
    return t.state_dict()["weight"]


# ---- prefetching over the tables of a PSModel (issue 41, item 8) --------------------------------------


class _BagNet(nn.Module):
    """A bag table (or a collection) under a Linear."""

    def __init__(self, bags: nn.Module, width: int) -> None:
        super().__init__()
        self.bags = bags
        self.top = nn.Linear(width, 1)

    def forward(self, batch: Any) -> torch.Tensor:
        if isinstance(batch, dict):
            out = self.bags(batch)
            return self.top(torch.cat([out[k] for k in sorted(out)], 1))
        return self.top(self.bags(batch[0], batch[1]))


def psmodel_tables(name: str, mode: str, prefetched: bool, holds: str = "bag", steps: int = 5) -> dict:
    """A PSModel over ps0 and ps1 holding a bag table (``holds="bag"``) or a collection of four
    under a Linear, trained ``steps`` steps with ``prefetching`` over the table (collection) or
    without: each output, the rows and dense values after, the messages sent to each server and
    the collection's own traffic counter (its ``messages``)."""
    from remote_module.ps import PSModel, prefetching

    common = {"ps_mode": mode, "half_async_merge_every": 1, "half_async_merge_s": 3600.0}
    if holds == "bag":
        bags: Any = table(f"{name}-bag", bag="sum", keep=False, **common)
        data: list = batches(5, steps)
        width = DIM
    else:
        bags = collection(name, mode)
        data = [{k: batches(50 + i, steps)[j] for i, k in enumerate("smxp")} for j in range(steps)]
        width = 4 * DIM
    torch.manual_seed(0)
    model = PSModel(_BagNet(bags, width), ["ps0", "ps1"], name=name, ps_mode=mode, num_trainers=1, min_block_size=1,
                    optimizer=(torch.optim.SGD, {"lr": 0.1}), half_async_merge_every=1, half_async_merge_s=3600.0)
    outs: list = []

    def run() -> None:
        source = prefetching(data, bags, features=lambda b: b) if prefetched else data
        for batch in source:
            out = model(batch)
            outs.append(out.detach().clone())
            ((out - 0.5) ** 2).sum().backward()
            model.step()

    messages = messages_per_call(run, 1)
    model.flush()
    traffic = {s: t["messages"] for s, t in getattr(bags, "traffic", {}).items()}
    return {"outs": outs, "rows": {k: v.clone() for k, v in model.state_dict().items()}, "messages": messages,
            "traffic": traffic}
