"""What the trainers run in tests/ps/test_collection.py."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

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


def train(job: str, steps: int, ps_mode: str = "async", collect: bool = True) -> dict:
    """``steps`` training steps of a collection (or of the same tables one by one); every
    output and the final weights."""
    model = make(job, ps_mode, collect=collect)
    outs = []
    for feats, targets in features(1, steps):
        if collect:
            got = model(feats)
        else:
            got = {name: model[name](*_args(value)) for name, value in feats.items()}
        outs.append({k: v.detach() for k, v in got.items()})
        sum(((got[k] - targets[k]) ** 2).sum() for k in got).backward()
        if collect:
            model.step()
        else:
            for table in model.values():
                table.step()
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


@contextlib.contextmanager
def pushes_replaced(table, rewrite):
    """Within the block, ``table``'s push plans send ``rewrite(calls)`` instead of their calls
    (their done / failed callbacks kept): a failure injected where the servers receive it."""
    real = table._push_plan

    def replaced():
        calls, done, failed = real()
        return rewrite(calls), done, failed

    table._push_plan = replaced
    try:
        yield
    finally:
        del table._push_plan


def refuse_push(*args) -> None:
    """A server-side push that fails (standing for a server that refused or was down)."""
    raise ValueError("push refused")


def partial_failure(job: str) -> dict:
    """A step whose pushes of one table all fail: that table keeps its gradients, the others
    count as stepped; a retry pushes that table only, and the weights end as in a run where
    nothing failed."""
    model, reference = make(job), make(job + "-ref")
    feats, targets = features(5, 1)[0]
    for m in (model, reference):
        got = m(feats)
        sum(((got[k] - targets[k]) ** 2).sum() for k in got).backward()
    reference.step()
    with pushes_replaced(model.table("users"), lambda calls: [(server, refuse_push, ()) for server, _, _ in calls]):
        try:
            model.step()
            error = "no error"
        except ValueError as exc:
            error = str(exc)
    after_failure = {k: v.clone() for k, v in model.state_dict().items()}
    model.step()  # the retry
    final = model.state_dict()
    return {
        "error": error,
        "others_stepped_once": all(torch.equal(after_failure[k], final[k]) for k in final if not k.startswith("users")),
        "users_stepped_by_retry": not torch.equal(after_failure["users.weight"], final["users.weight"]),
        "as_if_nothing_failed": all(torch.equal(final[k], reference.state_dict()[k]) for k in final),
    }


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
            error = "no error"
        except TypeError as exc:
            error = str(exc)
    model.step()
    got, want = model.state_dict(), reference.state_dict()
    return {"error": error, "same": sorted(k for k in got if torch.equal(got[k], want[k])), "keys": sorted(got)}

