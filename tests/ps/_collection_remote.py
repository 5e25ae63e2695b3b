"""What the trainers run in tests/ps/test_collection.py."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from tests._deadlines import HANG_S

SPECS = {  # name -> (rows, mode, padding_idx)
    "items": (300, "sum", None),
    "users": (120, "mean", 4),
    "tags": (50, "max", None),
}


def local_tables(seed: int = 0) -> dict[str, nn.EmbeddingBag]:
    torch.manual_seed(seed)
    return {name: nn.EmbeddingBag(rows, 4, mode=mode, padding_idx=pad) for name, (rows, mode, pad) in SPECS.items()}


def features(seed: int, steps: int) -> list[tuple[dict, dict]]:
    """Per step: each table's input in another of the accepted forms, and a target per table."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        items = torch.randint(0, 300, (10,), generator=g)
        weights = torch.rand(10, generator=g)
        users = torch.randint(0, 120, (3, 2), generator=g)
        users[0, 0] = 4  # the padding id
        tags = torch.randint(0, 50, (7,), generator=g)
        feats = {"items": (items, torch.tensor([0, 3, 3, 8]), weights), "users": users,
                 "tags": (tags, torch.tensor([0, 2, 5]))}
        targets = {"items": torch.randn(4, 4, generator=g), "users": torch.randn(3, 4, generator=g),
                   "tags": torch.randn(3, 4, generator=g)}
        out.append((feats, targets))
    return out


def _args(value):
    return value if isinstance(value, tuple) else (value,)


def make(job: str, ps_mode: str = "async", num_trainers: int = 1, collect: bool = True,
         servers: tuple = ("ps0", "ps1")):
    from remote_module.ps import ShardedEmbeddingBag, ShardedEmbeddingBagCollection

    tables = {}
    for name, (rows, mode, pad) in SPECS.items():
        tables[name] = ShardedEmbeddingBag(rows, 4, list(servers), name=f"{job}-{name}", mode=mode, padding_idx=pad,
                                           optimizer=(torch.optim.Adagrad, {"lr": 0.2}), min_block_size=40,
                                           ps_mode=ps_mode, num_trainers=num_trainers)
        tables[name].load_state_dict(local_tables()[name].state_dict())
    return ShardedEmbeddingBagCollection(tables) if collect else tables


def _forward(model: Any, feats: dict) -> dict:
    """A forward of a collection, or of the same tables one by one (a dict of them)."""
    if isinstance(model, dict):
        return {name: model[name](*_args(value)) for name, value in feats.items()}
    return model(feats)


def _step(model: Any) -> None:
    """A collection's step, or each table's (a dict of them)."""
    for table in model.values() if isinstance(model, dict) else [model]:
        table.step()


def train(job: str, steps: int, ps_mode: str = "async", collect: bool = True) -> dict:
    """``steps`` training steps of a collection (or of the same tables one by one); every
    output and the final weights."""
    model = make(job, ps_mode, collect=collect)
    outs = []
    for feats, targets in features(1, steps):
        got = _forward(model, feats)
        outs.append({k: v.detach() for k, v in got.items()})
        sum(((got[k] - targets[k]) ** 2).sum() for k in got).backward()
        _step(model)
    weights = model.state_dict() if collect else {f"{k}.weight": t.state_dict()["weight"] for k, t in model.items()}
    return {"outs": outs, "weights": weights}


def messages(job: str, ps_mode: str) -> dict:
    """Messages this trainer sends to each worker in one forward and in one step of a
    collection of three tables on two servers (counted at torch.distributed.rpc.rpc_async)."""
    from tests.benchmarks._common import messages_per_call

    model = make(job, ps_mode)
    feats, targets = features(2, 1)[0]
    model(feats)  # a first step outside the count (sync: the servers wait for it)
    got: dict = {}
    out = {"forward": messages_per_call(lambda: got.update(model(feats)), 1)}
    sum(((got[k] - targets[k]) ** 2).sum() for k in got).backward()
    out["step"] = messages_per_call(model.step, 1)
    return out


def refusals(job: str) -> list[str]:
    """The errors of bad collections and bad inputs, as ``TypeName: message``."""
    from remote_module.ps import ShardedEmbeddingBag, ShardedEmbeddingBagCollection

    model = make(job)
    feats, _ = features(3, 1)[0]
    texts = []

    def caught(fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the text is the point
            texts.append(f"{type(exc).__name__}: {exc}")
        else:
            texts.append("no error")

    caught(lambda: model({k: v for k, v in feats.items() if k != "users"}))
    caught(lambda: model({**feats, "nope": feats["users"]}))
    caught(lambda: model({**feats, "tags": (feats["users"], None, None, None)}))
    sync = ShardedEmbeddingBag(10, 4, ["ps0"], name=f"{job}-sync", ps_mode="sync")
    caught(lambda: ShardedEmbeddingBagCollection({"a": model.table("items"), "b": sync}))
    caught(lambda: ShardedEmbeddingBagCollection({"a": nn.EmbeddingBag(3, 4)}))
    caught(lambda: ShardedEmbeddingBagCollection({}))
    caught(lambda: model.table("nope"))
    caught(lambda: ShardedEmbeddingBagCollection({"a": model.table("items"), "b": model.table("items")}))
    caught(lambda: model({**feats, "users": feats["users"] + 1000}))  # ids out of range: the table's IndexError
    as_list = model({k: list(v) if isinstance(v, tuple) else v for k, v in feats.items()})
    as_tuple = model(feats)
    texts.append(str(all(torch.equal(as_list[k], as_tuple[k]) for k in as_tuple)))
    texts.append(f"{len(model)} {list(model)} {'items' in model} {model['tags'] is model.table('tags')}")
    return texts


def pooled_here_refusals(job: str) -> dict:
    """Arguments torch refuses, for tables whose bags are pooled on the trainer (per_sample_weights
    that need a gradient, geo mode): ``{case: (TypeName: message, messages sent)}``."""
    from remote_module.ps import ShardedEmbeddingBagCollection
    from tests.benchmarks._common import messages_per_call

    ids, offsets = torch.tensor([1, 2, 100]), torch.tensor([0, 1])
    weights = torch.rand(3, requires_grad=True)
    cases = {
        "weights with mean": ("async", {"users": (ids, offsets, weights)}),
        "weights too short": ("async", {"items": (ids, offsets, weights[:2])}),
        "geo 2-d input with offsets": ("geo", {"users": (ids.view(1, 3), offsets)}),
    }
    out = {}
    for case, (ps_mode, bad) in cases.items():
        model = ShardedEmbeddingBagCollection(make(f"{job}-{ps_mode}", ps_mode, collect=False))
        feats = {**features(3, 1)[0][0], **bad}
        text = []

        def call(model=model, feats=feats, text=text):
            try:
                model(feats)
            except Exception as exc:  # noqa: BLE001 - the text is the point
                text.append(f"{type(exc).__name__}: {exc}")

        sent = messages_per_call(call, 1)
        out[case] = (text[0] if text else "no error", sent)
    return out


def checkpoints(job: str) -> dict:
    """A collection's state_dict keys; that its state and optimizer state load into another, into
    local ``nn.EmbeddingBag``s by name (same outputs), and into one on three servers (the same
    next step)."""
    model = make(job)
    feats, targets = features(4, 1)[0]
    got = model(feats)
    sum(((got[k] - targets[k]) ** 2).sum() for k in got).backward()
    model.step()
    other = make(job + "-copy")
    other.load_state_dict(model.state_dict())
    other.load_optimizer_state_dict(model.optimizer_state_dict())
    same_state = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    opt_a, opt_b = model.optimizer_state_dict(), other.optimizer_state_dict()
    same_opt = all(torch.equal(opt_a[t]["sum"], opt_b[t]["sum"]) for t in opt_a)
    # into local nn.EmbeddingBags by name (a module holding them under the tables' names has the
    # collection's keys; nn.ModuleDict refuses the name "items", its method's): same outputs
    local = nn.Module()
    for k, bag in local_tables(seed=5).items():
        local.add_module(k, bag)
    local.load_state_dict(model.state_dict())
    later, later_targets = features(9, 1)[0]
    with torch.no_grad():
        want = {k: getattr(local, k)(*_args(v)) for k, v in later.items()}
        got = model(later)
    local_outputs = all(torch.allclose(got[k], want[k], atol=1e-6, rtol=0) for k in want)
    # re-sliced onto three servers: the same next step, the same weights after it
    three = make(job + "-three", servers=("ps0", "ps1", "ps2"))
    three.load_state_dict(model.state_dict())
    three.load_optimizer_state_dict(model.optimizer_state_dict())
    for m in (model, three):
        out = m(later)
        sum(((out[k] - later_targets[k]) ** 2).sum() for k in out).backward()
        m.step()
    resliced = all(torch.allclose(a, b, atol=1e-6, rtol=1e-5)
                   for a, b in zip(model.state_dict().values(), three.state_dict().values()))
    moved = not all(torch.equal(a, local.state_dict()[k]) for k, a in model.state_dict().items())
    return {"keys": sorted(model.state_dict()), "same_state": same_state, "same_optimizer_state": same_opt,
            "local_outputs": local_outputs, "resliced": resliced, "moved": moved}


def rollback(job: str) -> list[tuple[dict, dict]]:
    """State and optimizer state after steps 0 and 3 of a collection, once with steps 1 and 2
    taken in between and then rolled back (the checkpoint of step 0 loaded into the live
    tables, as "restore the best model" does), once without them."""
    feats = features(6, 4)
    out = []
    for run, detour in ((f"{job}-rolled", True), (f"{job}-straight", False)):
        model = make(run)

        def train_on(k: int) -> None:
            got = model(feats[k][0])
            sum(((got[n] - feats[k][1][n]) ** 2).sum() for n in got).backward()
            model.step()

        train_on(0)
        saved = model.state_dict(), model.optimizer_state_dict()
        if detour:
            train_on(1)
            train_on(2)
            model.load_state_dict(saved[0])
            model.load_optimizer_state_dict(saved[1])
        train_on(3)
        out.append((model.state_dict(), model.optimizer_state_dict()))
    return out


@contextlib.contextmanager
def pushes_replaced(table, rewrite):
    """Within the block, ``table``'s push plans send ``rewrite(calls)`` instead of their calls
    (their done / failed callbacks kept): a failure injected where the servers receive it."""
    real = table._push_plan

    def replaced(*args):
        plan = real(*args)
        return plan._replace(calls=rewrite(plan.calls))

    table._push_plan = replaced
    try:
        yield
    finally:
        del table._push_plan


def refuse_push(*args) -> None:
    """A server-side push that fails (standing for a server that refused or was down)."""
    raise ValueError("push refused")


def _misnamed(calls):
    """The same pushes for a table no server has: they travel packed with the other tables'
    pushes (the same handler and arguments) and fail on the servers."""
    return [(server, handler, push._replace(name=push.name + "-missing")) for server, handler, push in calls]


def _refused(calls):
    return [(server, refuse_push, ()) for server, _, _ in calls]


def partial_failure(job: str, how: str = "refused") -> dict:
    """A step whose pushes of one table all fail (``how``: "refused" by a handler of their
    own; "packed": inside the servers' packed push of every table): that table keeps its
    gradients, the others count as stepped; a retry pushes that table only, and the weights
    end as in a run where nothing failed."""
    model, reference = make(job), make(job + "-ref")
    feats, targets = features(5, 1)[0]
    for m in (model, reference):
        got = m(feats)
        sum(((got[k] - targets[k]) ** 2).sum() for k in got).backward()
    reference.step()
    with pushes_replaced(model.table("users"), {"refused": _refused, "packed": _misnamed}[how]):
        try:
            model.step()
            model.flush()  # (async: the step returns with its pushes in flight; the failure surfaces here)
            error = "no error"
        except (ValueError, LookupError) as exc:
            error = f"{type(exc).__name__}: {exc}"
    after_failure = {k: v.clone() for k, v in model.state_dict().items()}
    model.step()  # the retry
    final = model.state_dict()
    return {
        "error": error,
        "others_stepped_once": all(torch.equal(after_failure[k], final[k]) for k in final if not k.startswith("users")),
        "users_stepped_by_retry": not torch.equal(after_failure["users.weight"], final["users.weight"]),
        "as_if_nothing_failed": all(torch.equal(final[k], reference.state_dict()[k]) for k in final),
    }


def sync_retry(job: str, fail: bool, steps: int = 3) -> dict:
    """Trainer ``trainer0`` or ``trainer1`` of a sync collection (num_trainers=2, the same
    batches on both): with ``fail``, trainer0's first step fails for table ``users`` only and
    is retried. Each table's step count and, once both trainers ended, the final weights."""
    from remote_module.ps import ShardedEmbeddingBagCollection

    tables = make(job, "sync", num_trainers=2, collect=False)
    for table in tables.values():
        table.timeout = HANG_S  # a hang guard: a table whose trainers fell out of step fails by it
    model = ShardedEmbeddingBagCollection(tables, timeout=HANG_S)
    me = rpc_name()
    for step, (feats, targets) in enumerate(features(8, steps)):
        got = model(feats)
        sum(((got[k] - targets[k]) ** 2).sum() for k in got).backward()
        if fail and step == 0 and me == "trainer0":
            with pushes_replaced(model.table("users"),
                                 lambda calls: [(server, refuse_push, ()) for server, _, _ in calls]):
                with contextlib.suppress(ValueError):
                    model.step()
        model.step()  # (the retry)
    out: dict = {"steps": {name: t._step for name, t in model.tables().items()}}
    try:
        out["weights"] = model.state_dict()
    except Exception as exc:  # noqa: BLE001 - reported to pytest
        out["weights"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return out


def rpc_name() -> str:
    import torch.distributed.rpc as rpc

    return rpc.get_worker_info().name


class Ranker(nn.Module):
    """A collection under a dense layer: a PSModel's model."""

    def __init__(self, collection) -> None:
        super().__init__()
        self.tables = collection
        self.dense = nn.Linear(4, 1)

    def forward(self, feats):
        got = self.tables(feats)
        return sum(self.dense(v).sum() for v in got.values())


def psmodel_step_messages(job: str) -> dict:
    """Messages a PSModel (dense blocks on both servers, a collection of three tables) sends
    to each server in one step(), counted at rpc_async; and that the step trained everything."""
    from remote_module.ps import PSModel
    from tests.benchmarks._common import messages_per_call

    model = PSModel(Ranker(make(job)), ["ps0", "ps1"], name=job, num_trainers=1, ps_mode="async", min_block_size=1)
    feats, _ = features(6, 1)[0]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model(feats).backward()
    counted = messages_per_call(model.step, 1)
    after = model.state_dict()
    return {"messages": counted, "changed": sorted(k for k in after if not torch.equal(after[k], before[k]))}


def psmodel_unsendable_step(job: str) -> dict:
    """A PSModel step whose pushes cannot even be sent (an argument that does not pickle) keeps
    every part's gradients: the next step() pushes them, and the model ends as a reference
    model that stepped once."""
    import threading

    from remote_module.ps import PSModel

    def model_of(suffix: str):
        return PSModel(Ranker(make(job + suffix)), ["ps0", "ps1"], name=job + suffix, num_trainers=1,
                       ps_mode="async", min_block_size=1)

    model, reference = model_of(""), model_of("-ref")
    feats, _ = features(7, 1)[0]
    for m in (model, reference):
        m(feats).backward()
    reference.step()
    def unsendable(calls):
        return [(server, handler, (*args, threading.Lock())) for server, handler, args in calls]

    with pushes_replaced(model.module.tables.table("users"), unsendable):
        try:
            model.step()
            model.flush()  # (async: the step returns with its pushes in flight; the failure surfaces here)
            error = "no error"
        except TypeError as exc:
            error = str(exc)
    model.step()
    got, want = model.state_dict(), reference.state_dict()
    return {"error": error, "same": sorted(k for k in got if torch.equal(got[k], want[k])), "keys": sorted(got)}



# ---- plain sum / mean tables, planned together (remote_module/ps/tables/_packed.py) ----------------------

PLAIN = {  # name -> (rows, mode, servers, min_block_size)
    "clicks": (1000, "sum", ("ps0", "ps1"), 400),
    "views": (300, "mean", ("ps0", "ps1"), 200),
    "small": (50, "sum", ("ps1",), 8192),
    "ranked": (80, "max", ("ps0", "ps1"), 100),  # not planned with them: its own path, same message
    "frozen": (200, "sum", ("ps1", "ps0"), 200),  # requires_grad_(False); servers in the other order
}


def plain_features(seed: int, steps: int) -> list[tuple[dict, dict]]:
    """Per step: 1-d ids with offsets (an empty bag in "clicks"), 2-d ids, and targets."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        feats = {"clicks": (torch.randint(0, 1000, (12,), generator=g), torch.tensor([0, 4, 4, 9])),
                 "views": torch.randint(0, 300, (4, 3), generator=g),
                 "small": (torch.randint(0, 50, (6,), generator=g), torch.tensor([0, 1, 2, 5])),
                 "ranked": (torch.randint(0, 80, (8,), generator=g), torch.tensor([0, 3, 3, 6])),
                 "frozen": torch.randint(0, 200, (4, 2), generator=g)}
        out.append((feats, {k: torch.randn(4, 4, generator=g) for k in feats}))
    return out


def plain_make(job: str, ps_mode: str, num_trainers: int = 1):
    from remote_module.ps import ShardedEmbeddingBag

    torch.manual_seed(3)
    tables = {}
    for name, (rows, mode, servers, block) in PLAIN.items():
        t = ShardedEmbeddingBag(rows, 4, list(servers), name=f"{job}-{name}", mode=mode, min_block_size=block,
                                optimizer=(torch.optim.SGD, {"lr": 0.3}), ps_mode=ps_mode, num_trainers=num_trainers,
                                half_async_merge_every=2, half_async_merge_s=3600.0)  # by count only
        t.load_state_dict(nn.EmbeddingBag(rows, 4, mode=mode).state_dict())
        tables[name] = t
    tables["frozen"].requires_grad_(False)
    return tables


def plain_train(job: str, steps: int, ps_mode: str, collect: bool, num_trainers: int = 1, seed: int = 1) -> dict:
    """``steps`` steps of PLAIN's tables in a collection (or one by one): outputs, outputs under
    no_grad after each step, the final weights, and the messages of a forward (collection)."""
    from remote_module.ps import ShardedEmbeddingBagCollection
    from remote_module.ps.tables import _packed
    from tests.benchmarks._common import messages_per_call

    tables = plain_make(job, ps_mode, num_trainers)
    model = ShardedEmbeddingBagCollection(tables) if collect else None
    outs, evals, planned = [], [], []
    real_plan = _packed.plan

    def plan(owner, entries, wait_s):  # which tables each forward planned together
        made = real_plan(owner, entries, wait_s)
        planned.append(sorted(t.name.rsplit("-", 1)[1] for t, _, _ in entries) if made else None)
        return made

    _packed.plan = plan

    used = model if collect else tables
    for feats, targets in plain_features(seed, steps):
        got = _forward(used, feats)
        outs.append({k: v.detach() for k, v in got.items()})
        sum(((got[k] - targets[k]) ** 2).sum() for k in got).backward()
        _step(used)
        with torch.no_grad():
            evals.append(_forward(used, feats))
    messages = None
    if collect and num_trainers == 1:
        feats = plain_features(seed + 10, 1)[0][0]
        messages = messages_per_call(lambda: model(feats), 1)
        model.zero_grad()
    _packed.plan = real_plan
    return {"outs": outs, "evals": evals, "weights": {k: t.state_dict()["weight"] for k, t in tables.items()},
            "messages": messages, "planned": planned}


def plain_refusals(job: str) -> list[str]:
    """A bad input of a plain table: the collection's error, and the table's alone."""
    from remote_module.ps import ShardedEmbeddingBagCollection

    tables = plain_make(job, "async")
    model = ShardedEmbeddingBagCollection(tables)
    feats = plain_features(5, 1)[0][0]
    bad = {"out of range": {**feats, "clicks": (torch.tensor([1, 1000]), torch.tensor([0, 1]))},
           "negative": {**feats, "views": torch.tensor([[1, -1]])},
           "decreasing": {**feats, "clicks": (torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1]))},
           "not from 0": {**feats, "small": (torch.tensor([1, 2]), torch.tensor([1]))},
           "past the end": {**feats, "clicks": (torch.tensor([1, 2]), torch.tensor([0, 3]))}}
    texts = []
    for case, f in bad.items():
        for run in (lambda: model(f), lambda: {k: tables[k](*_args(v)) for k, v in f.items()}):
            try:
                run()
                texts.append(f"{case}: no error")
            except Exception as exc:  # noqa: BLE001 - the text is the point
                texts.append(f"{case}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    return texts


EDGES = {  # name -> (rows, dim, mode, servers, min_block_size): two embedding_dims
    "wide": (100, 8, "sum", ("ps0", "ps1"), 50),
    "clicks": (100, 4, "sum", ("ps0", "ps1"), 50),
    "deep": (60, 8, "mean", ("ps1", "ps0"), 30),
    "views": (60, 4, "mean", ("ps0", "ps1"), 30),
}


def edge_features() -> list[dict]:
    """Inputs the plans must take as the tables alone do: a table with no bag (2-d, 0 rows)
    last; ids of the first server's blocks only (the second server is not called)."""
    none = torch.zeros(0, 3, dtype=torch.long)
    return [{"wide": (torch.tensor([1, 70, 3]), torch.tensor([0, 2])), "clicks": torch.tensor([[5, 99], [50, 2]]),
             "deep": torch.tensor([[1, 59]]), "views": none},
            {"wide": (torch.tensor([1, 7]), torch.tensor([0, 1])), "clicks": torch.tensor([[5, 9], [0, 2]]),
             "deep": (torch.tensor([31, 40]), torch.tensor([0, 0])), "views": torch.tensor([[0, 29, 3]])}]


def plain_edges(job: str, collect: bool) -> dict:
    """EDGES' tables through edge_features() in a collection (or one by one): outputs, weights,
    which tables were planned together, each forward's messages (collection), and the error
    of a 2-d input of 0 columns (torch's "step must be nonzero")."""
    from remote_module.ps import ShardedEmbeddingBag, ShardedEmbeddingBagCollection
    from remote_module.ps.tables import _packed
    from tests.benchmarks._common import messages_per_call

    torch.manual_seed(5)
    tables = {}
    for key, (rows, dim, mode, servers, block) in EDGES.items():
        tables[key] = ShardedEmbeddingBag(rows, dim, list(servers), name=f"{job}-{key}", mode=mode,
                                          min_block_size=block, optimizer=(torch.optim.SGD, {"lr": 0.3}))
        tables[key].load_state_dict(nn.EmbeddingBag(rows, dim, mode=mode).state_dict())
    model = ShardedEmbeddingBagCollection(tables)
    planned, real_plan = [], _packed.plan

    def plan(owner, entries, wait_s):
        made = real_plan(owner, entries, wait_s)
        planned.append(sorted(t.name.rsplit("-", 1)[1] for t, _, _ in entries) if made else None)
        return made

    def forward(feats):
        return model(feats) if collect else {k: tables[k](*_args(v)) for k, v in feats.items()}

    _packed.plan = plan
    outs, messages = [], []
    try:
        for feats in edge_features():
            got = {}
            messages.append(messages_per_call(lambda feats=feats: got.update(forward(feats)), 1))
            outs.append({k: v.detach() for k, v in got.items()})
            sum((v * (i + 1)).pow(2).sum() for i, v in enumerate(got.values())).backward()
            if collect:
                model.step()
            else:
                for t in tables.values():
                    t.step()
        try:
            forward({**edge_features()[1], "views": torch.zeros(2, 0, dtype=torch.long)})
            refusal = "no error"
        except RuntimeError as exc:
            refusal = str(exc)
    finally:
        _packed.plan = real_plan
    return {"outs": outs, "weights": {k: t.state_dict()["weight"] for k, t in tables.items()},
            "planned": planned, "messages": messages, "refusal": refusal}


def plain_grad_idioms(job: str, collect: bool) -> dict:
    """torch's gradient idioms on PLAIN's tables (in a collection, planned together, or one by
    one) under a local Linear: ``torch.autograd.grad`` of the dense weights and
    ``backward(inputs=dense)`` record nothing for the tables (a step after them pushes
    nothing); two forwards then one backward accumulate both. The weights after each, and
    which outputs require grad."""
    from remote_module.ps import ShardedEmbeddingBagCollection

    tables = plain_make(job, "async")
    initial = {k: t.state_dict()["weight"] for k, t in tables.items()}
    used = ShardedEmbeddingBagCollection(tables) if collect else tables
    torch.manual_seed(5)
    lin = nn.Linear(4, 1)
    batches = [feats for feats, _ in plain_features(7, 3)]

    def loss_of(feats: dict) -> tuple[torch.Tensor, dict]:
        got = _forward(used, feats)
        return sum(lin(v).pow(2).sum() for v in got.values()), got

    def weights() -> dict:
        _step(used)
        return {k: t.state_dict()["weight"] for k, t in tables.items()}

    loss, got = loss_of(batches[0])
    requires = {k: v.requires_grad for k, v in got.items()}
    markers = [t.grad_marker for k, t in tables.items() if k != "frozen"]
    torch.autograd.grad(loss, list(lin.parameters()) + markers)  # (runs the tables' nodes, sets no .grad)
    after_grad = weights()
    loss, _ = loss_of(batches[1])
    loss.backward(inputs=list(lin.parameters()))
    after_inputs = weights()
    first, _ = loss_of(batches[1])
    second, _ = loss_of(batches[2])
    (first + second).backward()
    return {"initial": initial, "requires": requires, "after_grad": after_grad, "after_inputs": after_inputs,
            "after_two": weights()}


def together_failure(job: str, how: str) -> dict:
    """sync, one trainer: PLAIN's tables in a collection, two steps; the first step's pushes of
    the tables recorded together fail in part: ``how`` "message", ps0's call refused (as a
    server down would fail it); "entry", the clicks table's entry on ps1 refused by that server
    (a name it does not hold). Which tables kept their gradients, the error, then step() again
    (the retry) and a second step; the weights, and those of the same two steps without a
    failure."""
    from remote_module.ps import ShardedEmbeddingBagCollection
    from remote_module.ps.tables import _packed

    tables = plain_make(job, "sync")
    model = ShardedEmbeddingBagCollection(tables)
    real = _packed.push_together

    def broken(together, members, done):
        plan = real(together, members, done)
        for k, (server, handler, push) in enumerate(plan.calls):  # (in place: the plan settles by them)
            if how == "message" and server == "ps0":
                plan.calls[k] = (server, refuse_push, ())
            elif how == "entry" and server == "ps1":
                push.entries[:] = [e._replace(name=e.name + "-not-here") if e.name.endswith("-clicks") else e
                                   for e in push.entries]
        return plan

    out: dict = {}
    for step, (feats, targets) in enumerate(plain_features(1, 2)):
        got = _forward(model, feats)
        sum(((got[k] - targets[k]) ** 2).sum() for k in got).backward()
        if step == 0:
            _packed.push_together = broken
            try:
                model.step()
                out["error"] = None
            except Exception as exc:  # noqa: BLE001  (the outcome is the test's)
                out["error"] = f"{type(exc).__name__}: {exc}"
            finally:
                _packed.push_together = real
            out["kept"] = sorted(k for k, t in tables.items() if t._held)
        model.step()
    out["weights"] = {k: t.state_dict()["weight"] for k, t in tables.items()}
    out["reference"] = plain_train(job + "-reference", 2, "sync", True)["weights"]
    return out


def plain_unused_output(job: str, collect: bool) -> dict:
    """Two steps of PLAIN's tables with a SparseAdam (per-row moments: a zero gradient still
    moves a row): the first loss uses every output, the second only "clicks"'s. As torch, a
    table whose output is not in the loss gets no gradient and is not stepped. The weights."""
    from remote_module.ps import ShardedEmbeddingBag, ShardedEmbeddingBagCollection

    torch.manual_seed(3)
    tables = {}
    for name, (rows, mode, servers, block) in PLAIN.items():
        if name in ("ranked", "frozen"):
            continue
        t = ShardedEmbeddingBag(rows, 4, list(servers), name=f"{job}-{name}", mode=mode, min_block_size=block,
                                optimizer=(torch.optim.SparseAdam, {"lr": 0.1}))
        t.load_state_dict(nn.EmbeddingBag(rows, 4, mode=mode).state_dict())
        tables[name] = t
    used = ShardedEmbeddingBagCollection(tables) if collect else tables
    for step, (feats, targets) in enumerate(plain_features(1, 2)):
        got = _forward(used, {k: v for k, v in feats.items() if k in tables})
        keys = list(got) if step == 0 else ["clicks"]
        sum(((got[k] - targets[k]) ** 2).sum() for k in keys).backward()
        _step(used)
    return {k: t.state_dict()["weight"] for k, t in tables.items()}


def pushed_bytes_counted(job: str) -> dict:
    """Two steps of PLAIN's tables in a collection (the sum / mean ones pushed together, one
    call per server): per step, the sum of the tables' ``pushed_bytes`` added, and the tensor
    bytes of the push calls the step sent (every server's call carries its own copy)."""
    from remote_module.ps import ShardedEmbeddingBagCollection
    from remote_module.ps.tables.server import _handlers

    tables = plain_make(job, "async")
    model = ShardedEmbeddingBagCollection(tables)
    pushes = (_handlers._push_bag_tables, _handlers._push_tables, _handlers._push_rows)
    sent: list[int] = []
    real_count = model._count

    def count(calls: list) -> list:
        sent.append(sum(a.numel() * a.element_size() for _, handler, args in calls if handler in pushes
                        for a in args if isinstance(a, torch.Tensor)))
        return real_count(calls)

    model._count = count
    counted, steps = [], []
    for feats, targets in plain_features(1, 2):
        got = model(feats)
        sum(((got[k] - targets[k]) ** 2).sum() for k in got).backward()
        before, mark = sum(t.pushed_bytes for t in tables.values()), len(sent)
        model.step()
        counted.append(sum(t.pushed_bytes for t in tables.values()) - before)
        steps.append(sum(sent[mark:]))
    model.flush()
    return {"counted": counted, "sent": steps}


def packed_push_rows(job: str) -> dict:
    """A step of PLAIN's tables in a collection, their sum / mean lookups planned together: per
    server, the bags with ids there in the forward's call, and the rows of pooled-bag gradient
    the step's call to it carries."""
    from remote_module.ps import ShardedEmbeddingBagCollection
    from remote_module.ps.tables.server import _handlers

    tables = plain_make(job, "async")
    model = ShardedEmbeddingBagCollection(tables)
    bags: dict[str, int] = {}
    rows: dict[str, int] = {}
    real_count = model._count

    def count(calls: list) -> list:
        for server, handler, args in calls:
            if handler is _handlers._pool_tables:
                ids, first = args.ids, args.first
                ends = torch.cat([first[1:], first.new_tensor([ids.numel()])])
                bags[server] = int((ends > first).sum())
            elif handler is _handlers._push_bag_tables:
                rows[server] = max(a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.is_floating_point())
        return real_count(calls)

    model._count = count
    feats, targets = plain_features(1, 1)[0]
    got = model(feats)
    sum(((got[k] - targets[k]) ** 2).sum() for k in got).backward()
    model.step()
    model.flush()
    return {"bags": bags, "rows": rows, "all_bags": sum(v.shape[0] for v in got.values())}


def geo_traffic(job: str) -> dict:
    """A geo collection (deltas pushed every 2 steps) trained 3 steps, then flushed: its
    traffic after the steps and after the flush, and the distinct rows looked up (so cached) in
    each push's interval (steps 1-2, step 3), whose deltas those pushes carry (the padding
    row's too, a zero delta)."""
    from remote_module.ps import ShardedEmbeddingBag, ShardedEmbeddingBagCollection

    specs = {name: SPECS[name] for name in ("items", "users")}
    tables = {name: ShardedEmbeddingBag(rows, 4, ["ps0", "ps1"], name=f"{job}-{name}", mode=mode, padding_idx=pad,
                                        optimizer=(torch.optim.Adagrad, {"lr": 0.2}), min_block_size=40,
                                        ps_mode="geo", geo_push_every=2)
              for name, (rows, mode, pad) in specs.items()}
    model = ShardedEmbeddingBagCollection(tables)
    cached: list[dict[str, list]] = [{name: [] for name in specs} for _ in range(2)]
    for step, (feats, targets) in enumerate(features(4, 3)):
        feats = {name: feats[name] for name in specs}
        got = model(feats)
        sum(((got[k] - targets[k]) ** 2).sum() for k in got).backward()
        model.step()
        for name, value in feats.items():
            cached[step // 2][name].append(_args(value)[0].flatten())
    after_steps = {server: dict(t) for server, t in model.traffic.items()}
    model.flush()
    return {"steps": after_steps, "flushed": {server: dict(t) for server, t in model.traffic.items()},
            "cached": [sum(int(torch.cat(ids).unique().numel()) for ids in part.values()) for part in cached]}


def plain_plan_shares(job: str) -> list[str]:
    """Batches of PLAIN's sum / mean tables with irregular bags (empty ones first, inside and
    last; a table with no bag at all; every id on one server; a table over three servers),
    planned together: the mismatches of each server's ids and each bag's first id there (the
    ids before its start), and of each position's bag, against what searching the batch finds
    (none expected)."""
    from remote_module.ps.tables import _packed

    tables = plain_make(job, "async")
    g = torch.Generator().manual_seed(11)
    batches = [
        {"clicks": (torch.randint(0, 1000, (9,), generator=g), torch.tensor([0, 0, 3, 3, 9, 9])),
         "views": (torch.randint(0, 300, (5,), generator=g), torch.tensor([0, 0, 0, 5])),
         "small": (torch.randint(0, 50, (3,), generator=g), torch.tensor([0, 2, 3]))},
        {"clicks": torch.randint(0, 1000, (0, 3), generator=g),  # no bag at all
         "views": torch.randint(0, 300, (2, 4), generator=g),
         "frozen": (torch.randint(0, 200, (4,), generator=g), torch.tensor([0, 4, 4]))},
        {"clicks": (torch.randint(0, 400, (6,), generator=g), torch.tensor([0, 1, 6])),  # all on ps0
         "views": (torch.randint(0, 200, (0,), generator=g), torch.tensor([0, 0]))},
        {"wide": (torch.randint(0, 900, (40,), generator=g), torch.tensor([0, 0, 7, 19, 19, 33])),  # 3 servers
         "clicks": (torch.randint(0, 1000, (12,), generator=g), torch.tensor([0, 5, 5]))},
    ]
    from remote_module.ps import ShardedEmbeddingBag

    tables["wide"] = ShardedEmbeddingBag(900, 4, ["ps2", "ps0", "ps1"], name=f"{job}-wide", mode="sum",
                                         min_block_size=400, optimizer=(torch.optim.SGD, {"lr": 0.3}))
    wrong = []
    for k, feats in enumerate(batches):
        entries = [(tables[n], *(v if isinstance(v, tuple) else (v, None))) for n, v in feats.items()]
        made = _packed.plan({}, entries, 60.0)
        batch = made.finish.args[0]
        positions = torch.arange(batch.flat.numel())
        bag_of = torch.searchsorted(batch.starts, positions, right=True) - 1
        # (each position's bag as the path of a table of another dtype counts it)
        if not torch.equal(_packed.bag_index(batch.starts, batch.flat.numel(), check=False), bag_of):
            wrong.append(f"batch {k}: bag_index {bag_of.tolist()}")
        layout = batch.layout
        gid = batch.flat + torch.repeat_interleave(torch.tensor(layout.id_base[:-1]), torch.from_numpy(batch.counts))
        block_starts, block_server = torch.from_numpy(layout.block_starts), torch.from_numpy(layout.block_server)
        server_of = block_server[torch.searchsorted(block_starts, gid, right=True) - 1]
        called = [s for s in range(len(layout.servers)) if bool((server_of == s).any())]
        if [s for s, _, _ in batch.shares] != called:
            wrong.append(f"batch {k}: servers called {[s for s, _, _ in batch.shares]}, not {called}")
        for s, ids, first in batch.shares:
            at = (server_of == s).nonzero().reshape(-1)
            if not torch.equal(ids, batch.flat[at].to(layout.wire)):
                wrong.append(f"batch {k} server {s}: ids {ids.tolist()}")
            want = torch.searchsorted(bag_of[at], torch.arange(batch.starts.numel()))
            if first.dtype != torch.long or not torch.equal(first, want):
                wrong.append(f"batch {k} server {s}: first {first.tolist()}, not {want.tolist()}")
    return wrong


RUNS = {  # name -> (rows, mode, servers, min_block_size): ps0 serves all, ps1 a run of them, ps2 two apart
    "a": (200, "sum", ("ps0", "ps1"), 100),
    "c": (60, "mean", ("ps0", "ps1"), 40),
    "b": (90, "sum", ("ps0", "ps2"), 60),
    "d": (40, "sum", ("ps0",), 8192),
    "e": (120, "mean", ("ps0", "ps2"), 80),
}


def runs_tables(job: str) -> dict:
    """RUNS' tables (dim 4, SGD), each starting from a local ``nn.EmbeddingBag``'s rows (seed 6)."""
    from remote_module.ps import ShardedEmbeddingBag

    torch.manual_seed(6)
    tables = {}
    for key, (rows, mode, servers, block) in RUNS.items():
        tables[key] = ShardedEmbeddingBag(rows, 4, list(servers), name=f"{job}-{key}", mode=mode,
                                          min_block_size=block, optimizer=(torch.optim.SGD, {"lr": 0.3}))
        tables[key].load_state_dict(nn.EmbeddingBag(rows, 4, mode=mode).state_dict())
    return tables


def served_runs(job: str, collect: bool) -> dict:
    """RUNS' tables (dim 4) trained 3 steps in a collection (or one by one): outputs, weights,
    and how each server's part of the collection's output is added (None: every bag, "slice":
    a run of tables, "index": tables apart)."""
    from remote_module.ps import ShardedEmbeddingBagCollection

    tables = runs_tables(job)
    model = ShardedEmbeddingBagCollection(tables)
    g = torch.Generator().manual_seed(8)
    outs = []
    for _ in range(3):
        feats = {}
        for key, (rows, _, _, _) in RUNS.items():
            ids = torch.randint(0, rows, (14,), generator=g)
            feats[key] = (ids, torch.tensor([0, 0, 3, 9, 9, 13]))
        used = model if collect else tables
        got = _forward(used, feats)
        outs.append({k: v.detach() for k, v in got.items()})
        sum((v * (i + 1)).pow(2).sum() for i, v in enumerate(got.values())).backward()
        _step(used)
    adds = None
    if collect:
        (layout,) = [lay for by_bags in model._layouts.values() for lay in by_bags.values()]
        adds = [None if r is None else "slice" if isinstance(r, slice) else "index" for r in layout.rows]
    return {"outs": outs, "weights": {k: t.state_dict()["weight"] for k, t in tables.items()}, "adds": adds,
            "servers": None if adds is None else layout.servers}


def default_double(job: str, collect: bool) -> dict:
    """With the trainer's default dtype float64 (``torch.set_default_dtype``): RUNS' tables and
    one on three servers, in a collection (or one by one), outputs with and without recording."""
    from remote_module.ps import ShardedEmbeddingBag, ShardedEmbeddingBagCollection

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        tables = runs_tables(job)
        tables["three"] = ShardedEmbeddingBag(300, 4, ["ps0", "ps1", "ps2"], name=f"{job}-three", min_block_size=100,
                                              mode="sum", optimizer=(torch.optim.SGD, {"lr": 0.3}))
        tables["three"].load_state_dict({"weight": torch.randn(300, 4) * 1e3})  # (sums that round)
        model = ShardedEmbeddingBagCollection(tables) if collect else None
        g = torch.Generator().manual_seed(8)
        feats = {k: (torch.randint(0, rows, (14,), generator=g), torch.tensor([0, 0, 3, 9, 9, 13]))
                 for k, (rows, _, _, _) in RUNS.items()}
        feats["three"] = (torch.arange(0, 300, 7), torch.tensor([0, 10, 20, 30]))
        outs = []
        for grad in (False, True):
            with torch.set_grad_enabled(grad):
                got = model(feats) if collect else {k: tables[k](*v) for k, v in feats.items()}
            outs.append({k: v.detach() for k, v in got.items()})
        return {"outs": outs}
    finally:
        torch.set_default_dtype(before)


def default_double_apart(job: str, collect: bool) -> dict:
    """With the default dtype float64: three tables of one server each, no server holding them
    all (ps1 two apart: its part added by index), in a collection (or one by one): outputs."""
    from remote_module.ps import ShardedEmbeddingBag, ShardedEmbeddingBagCollection

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        g = torch.Generator().manual_seed(2)
        tables = {}
        for key, server in (("x", "ps1"), ("y", "ps2"), ("z", "ps1")):
            tables[key] = ShardedEmbeddingBag(50, 4, [server], name=f"{job}-{key}", mode="sum",
                                              optimizer=(torch.optim.SGD, {"lr": 0.3}))
            tables[key].load_state_dict({"weight": torch.randn(50, 4, generator=g)})
        model = ShardedEmbeddingBagCollection(tables) if collect else None
        feats = {k: (torch.arange(0, 50, 5), torch.tensor([0, 3, 7])) for k in tables}
        got = model(feats) if collect else {k: tables[k](*v) for k, v in feats.items()}
        return {k: v.detach() for k, v in got.items()}
    finally:
        torch.set_default_dtype(before)
