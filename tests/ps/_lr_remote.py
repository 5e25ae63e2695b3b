"""What the LR-schedule tests run on their trainers (tests/ps/test_lr_schedules.py): a PSModel
whose ``ps_optimizer`` a torch LR scheduler drives, trained on the batches pytest rebuilds."""

from __future__ import annotations

from typing import Any, Callable

import torch

from tests._deadlines import HANG_S
from tests.ps._dense_remote import Net, batch

#: fixed "validation losses" for ReduceLROnPlateau (every trainer steps it on the same ones)
METRICS = [1.0, 0.9, 0.95, 0.97, 0.8, 0.85, 0.9, 0.7]
LR, MOMENTUM = 0.2, 0.9


def scheduler(kind: str, opt: torch.optim.Optimizer, steps: int) -> Any:
    sched = torch.optim.lr_scheduler
    if kind == "step":
        return sched.StepLR(opt, step_size=2, gamma=0.5)
    if kind == "lambda":
        return sched.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    if kind == "plateau":
        return sched.ReduceLROnPlateau(opt, factor=0.5, patience=0)
    if kind == "onecycle":  # (momentum cycles too: the servers' SGD has momentum)
        return sched.OneCycleLR(opt, max_lr=0.5, total_steps=steps, base_momentum=0.8, max_momentum=0.9)
    raise ValueError(kind)


def advance(kind: str, sched: Any, step: int) -> None:
    if kind == "plateau":
        sched.step(METRICS[step])
    else:
        sched.step()


def train(name: str, kind: str, trainer: int, num_trainers: int, steps: int, start: int = 0,
          state: dict | None = None) -> dict:
    """``steps`` sync steps of trainer ``trainer``'s batches from ``start`` on; ``state``: a
    checkpoint to load first (model, optimizer, scheduler). The weights after, the lrs used,
    and a checkpoint."""
    from remote_module.ps import PSModel

    torch.manual_seed(0)
    model = PSModel(Net(), ["ps0", "ps1"], name=name, num_trainers=num_trainers, ps_mode="sync",
                    optimizer=(torch.optim.SGD, {"lr": LR, "momentum": MOMENTUM}), min_block_size=4)
    sched = scheduler(kind, model.ps_optimizer, 8)
    if state is not None:
        model.load_state_dict(state["model"])
        model.load_optimizer_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
    lrs = []
    for k in range(start, start + steps):
        x, y = batch(trainer, k)
        ((model(x) - y) ** 2).mean().backward()
        lrs.append(model.ps_optimizer.param_groups[0]["lr"])
        model.step()
        advance(kind, sched, k)
    checkpoint = {"model": model.state_dict(), "optim": model.optimizer_state_dict(), "sched": sched.state_dict()}
    return {"weights": {k: v.detach().clone() for k, v in model.module.state_dict().items()}, "lrs": lrs,
            "checkpoint": checkpoint}


def disagree(name: str, trainer: int) -> str:
    """Two sync trainers whose ps_optimizer lrs differ: what the step after raises."""
    from remote_module.ps import PSModel

    torch.manual_seed(0)
    model = PSModel(Net(), ["ps0", "ps1"], name=name, num_trainers=2, ps_mode="sync",
                    optimizer=(torch.optim.SGD, {"lr": LR}), min_block_size=4, timeout=HANG_S)
    if trainer == 1:
        model.ps_optimizer.param_groups[0]["lr"] = LR / 2
    x, y = batch(trainer, 0)
    ((model(x) - y) ** 2).mean().backward()
    try:
        model.step()
        model.pull()
    except Exception as exc:  # noqa: BLE001 (its type is what the test checks)
        return f"{type(exc).__name__}: {exc}"
    return "no error"


# ---- a ShardedEmbeddingBag's ps_optimizer ---------------------------------------------------------

ROWS, DIM = 40, 4


def bag_batch(trainer: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Trainer ``trainer``'s bags for ``step``: 6 bags of 3 ids (repeats included) and targets."""
    g = torch.Generator().manual_seed(5000 + 100 * trainer + step)
    return torch.randint(0, ROWS, (18,), generator=g), torch.arange(6) * 3, torch.randn(6, DIM, generator=g)


def table_optimizer(kind: str) -> tuple[type, dict]:
    # OneCycleLR cycles SparseAdam's betas (row-wise SGD has no momentum to cycle)
    return (torch.optim.SparseAdam, {"lr": 0.05}) if kind == "onecycle" else (torch.optim.SGD, {"lr": 0.5})


def initial_rows() -> torch.Tensor:
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(7))


def train_bag(name: str, kind: str, trainer: int, num_trainers: int, steps: int) -> dict:
    """``steps`` sync steps of a sum ShardedEmbeddingBag on ps0 and ps1 whose ps_optimizer a
    scheduler drives: its rows after, and the lrs used."""
    from remote_module.ps import ShardedEmbeddingBag

    bag = ShardedEmbeddingBag(ROWS, DIM, ["ps0", "ps1"], name=name, mode="sum", ps_mode="sync",
                              num_trainers=num_trainers, optimizer=table_optimizer(kind),
                              min_block_size=ROWS // 2 * DIM)
    bag.load_state_dict({"weight": initial_rows()})
    sched = scheduler(kind, bag.ps_optimizer, 8)
    lrs = []
    for k in range(steps):
        ids, offsets, target = bag_batch(trainer, k)
        ((bag(ids, offsets) - target) ** 2).mean().backward()
        lrs.append(bag.ps_optimizer.param_groups[0]["lr"])
        bag.step()
        advance(kind, sched, k)
    with torch.no_grad():
        bag(*bag_batch(trainer, 0)[:2])  # (sync: waits for the last step)
    return {"rows": bag.state_dict()["weight"], "lrs": lrs}


def train_collection(name: str, trainer: int, steps: int) -> dict:
    """Two sum bags in a collection, 2 sync trainers, a StepLR on the collection's ps_optimizer:
    each table's rows after, the lrs used, and a table's lr after its ps_optimizer was loaded."""
    from remote_module.ps import ShardedEmbeddingBag, ShardedEmbeddingBagCollection

    tables = {}
    for k in ("a", "b"):
        bag = ShardedEmbeddingBag(ROWS, DIM, ["ps0", "ps1"], name=f"{name}-{k}", mode="sum", ps_mode="sync",
                                  num_trainers=2, optimizer=(torch.optim.SGD, {"lr": 0.5}),
                                  min_block_size=ROWS // 2 * DIM)
        bag.load_state_dict({"weight": initial_rows()})
        tables[k] = bag
    ebc = ShardedEmbeddingBagCollection(tables)
    sched = torch.optim.lr_scheduler.StepLR(ebc.ps_optimizer, step_size=2, gamma=0.5)
    lrs = []
    for k in range(steps):
        ids, offsets, target = bag_batch(trainer, k)
        out = ebc({"a": (ids, offsets), "b": (ids.flip(0), offsets)})
        ((out["a"] - target) ** 2 + (out["b"] + target) ** 2).mean().backward()
        lrs.append([g["lr"] for g in ebc.ps_optimizer.param_groups])
        ebc.step()
        sched.step()
    with torch.no_grad():
        ebc({"a": bag_batch(trainer, 0)[:2], "b": bag_batch(trainer, 0)[:2]})  # (sync: the last step)
    saved = ebc.ps_optimizer.state_dict()
    tables["a"].ps_optimizer.param_groups[0]["lr"] = 9.0
    ebc.ps_optimizer.load_state_dict(saved)
    return {"rows": {k: t.state_dict()["weight"] for k, t in tables.items()}, "lrs": lrs,
            "restored": tables["a"].ps_optimizer.param_groups[0]["lr"]}


def collection_scheduled_warnings(name: str) -> list[str]:
    """A StepLR on a collection's ps_optimizer (the documented way to schedule its tables),
    stepped after each ``ebc.step()``: the warnings raised."""
    import warnings

    from remote_module.ps import ShardedEmbeddingBag, ShardedEmbeddingBagCollection

    bag = ShardedEmbeddingBag(ROWS, DIM, ["ps0"], name=name, mode="sum", optimizer=(torch.optim.SGD, {"lr": 0.5}))
    ebc = ShardedEmbeddingBagCollection({"a": bag})
    sched = torch.optim.lr_scheduler.StepLR(ebc.ps_optimizer, step_size=1, gamma=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(3):
            ids, offsets, target = bag_batch(0, k)
            ((ebc({"a": (ids, offsets)})["a"] - target) ** 2).mean().backward()
            ebc.step()
            sched.step()
        ebc.flush()
    return [f"{w.category.__name__}: {w.message}" for w in caught]


# ---- async: each push is applied with its own trainer's settings ---------------------------------


def _wait_for(path: str, seconds: float = HANG_S) -> None:
    import os
    import time

    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"hang guard: {path} did not appear within {seconds} s")
        time.sleep(0.02)


def async_own_settings(name: str, trainer: int, flags: str, table: bool) -> float | None:
    """Two async trainers of a PSModel (``table``: a ShardedEmbeddingBag) on ps0 and ps1:
    trainer0 steps once with lr 0.1 (sent), then trainer1 hand-sets lr 0 and steps once, then
    trainer0 steps again, its lr unchanged (not sent again). What trainer0's second step moved
    (its push is the latest: lr 0.1, not trainer1's 0)."""
    from remote_module.ps import PSModel, ShardedEmbeddingBag

    torch.manual_seed(0)
    if table:
        model = ShardedEmbeddingBag(ROWS, DIM, ["ps0", "ps1"], name=name, mode="sum", ps_mode="async",
                                    num_trainers=2, optimizer=(torch.optim.SGD, {"lr": 0.1}),
                                    min_block_size=ROWS // 2 * DIM)
        ids, offsets, target = bag_batch(0, 0)

        def train() -> None:
            ((model(ids, offsets) - target) ** 2).mean().backward()
            model.step()
            model.flush()

        def values() -> torch.Tensor:
            return model.state_dict()["weight"].clone()
    else:
        model = PSModel(Net(), ["ps0", "ps1"], name=name, num_trainers=2, ps_mode="async",
                        optimizer=(torch.optim.SGD, {"lr": 0.1}), min_block_size=4)
        x, y = batch(trainer, 0)

        def train() -> None:
            ((model(x) - y) ** 2).mean().backward()
            model.step()
            model.flush()

        def values() -> torch.Tensor:
            with torch.no_grad():
                model(x)  # (pulls)
            return torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
    if trainer == 1:
        _wait_for(flags + ".0")
        model.ps_optimizer.param_groups[0]["lr"] = 0.0
        train()
        open(flags + ".1", "w").close()
        return None
    train()
    open(flags + ".0", "w").close()
    _wait_for(flags + ".1")
    before = values()
    train()
    return float((values() - before).abs().max())


# ---- a setting the rows cannot take raises before anything is taken -------------------------------


def bad_table_setting(name: str, mode: str, where: str) -> dict:
    """Two sum tables, in a PSModel (with a Linear after them) or a collection, trained one
    step; run "bad": table b's ps_optimizer has momentum 0.5 at the first step() (a
    ValueError), then 0 and step() again; run "clean": one step(). Each run's error and values
    after (the tables' rows; a PSModel's Linear too)."""
    from torch import nn

    from remote_module.ps import PSModel, ShardedEmbeddingBag, ShardedEmbeddingBagCollection

    out = {}
    for run in ("bad", "clean"):
        torch.manual_seed(0)
        tables = {t: ShardedEmbeddingBag(ROWS, DIM, ["ps0", "ps1"], name=f"{name}-{run}-{t}", mode="sum",
                                         ps_mode=mode, num_trainers=1, optimizer=(torch.optim.SGD, {"lr": 0.5}),
                                         min_block_size=ROWS // 2 * DIM) for t in ("a", "b")}
        for table in tables.values():
            table.load_state_dict({"weight": initial_rows()})
        ids, offsets, target = bag_batch(0, 0)
        if where == "psmodel":
            module = nn.Module()
            module.a, module.b, module.lin = tables["a"], tables["b"], nn.Linear(DIM, DIM)
            module.forward = lambda i, o: module.lin(module.a(i, o) + module.b(i, o))  # type: ignore[method-assign]
            model = PSModel(module, ["ps0", "ps1"], name=f"{name}-{run}-m", num_trainers=1, ps_mode=mode,
                            optimizer=(torch.optim.SGD, {"lr": 0.1}), min_block_size=4)
            ((model(ids, offsets) - target) ** 2).mean().backward()
        else:
            model = ShardedEmbeddingBagCollection(tables)
            pooled = model({"a": (ids, offsets), "b": (ids, offsets)})
            ((pooled["a"] + pooled["b"] - target) ** 2).mean().backward()
        error = None
        if run == "bad":
            tables["b"].ps_optimizer.param_groups[0]["momentum"] = 0.5
            try:
                model.step()
            except ValueError as exc:
                error = str(exc)
            tables["b"].ps_optimizer.param_groups[0]["momentum"] = 0.0
        model.step()
        model.flush()
        values = {t: table.state_dict()["weight"].clone() for t, table in tables.items()}
        if where == "psmodel":
            with torch.no_grad():
                model(ids, offsets)  # (pulls)
            values.update({k: v.detach().clone() for k, v in module.lin.state_dict().items()})
        out[run] = (error, values)
    return out


# ---- a local optimizer over a PSModel's parameters ------------------------------------------------

def _watched_port(name: str, loop: Callable[[Any], None]) -> dict:
    """An async PSModel (Net on ps0 and ps1) trained by ``loop(model)``, a ported script's
    loop: the warnings raised meanwhile, and whether the servers' values moved."""
    import warnings

    from remote_module.ps import PSModel

    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PSModel(Net(), ["ps0", "ps1"], name=name, num_trainers=1, ps_mode="async",
                        optimizer=(torch.optim.SGD, {"lr": LR}), min_block_size=4)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        loop(model)
        after = model.state_dict()
    moved = any(not torch.equal(before[k], after[k]) for k in before)
    return {"warnings": [f"{w.category.__name__}: {w.message}" for w in caught], "moved": moved}


def local_optimizer(name: str, model_step: bool = True) -> dict:
    """A port that keeps its script's own optimizer: ``SGD(model.parameters())`` with a StepLR
    on it (``model.step()`` after its step, or, ``model_step=False``, forgotten). The warnings
    raised, and whether the servers' values moved."""

    def loop(model: Any) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for k in range(3):
            x, y = batch(0, k)
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            if model_step:
                model.step()
            sched.step()

    return _watched_port(name, loop)


def ps_optimizer_step_only(name: str) -> dict:
    """A port that made ``optimizer = model.ps_optimizer`` and kept the script's
    ``optimizer.step()``, without ``model.step()``: the warnings, and whether the servers moved."""

    def loop(model: Any) -> None:
        optimizer = model.ps_optimizer
        for k in range(4):
            x, y = batch(0, k)
            optimizer.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            optimizer.step()

    return _watched_port(name, loop)


# ---- cyclic schedulers on a collection's ps_optimizer ---------------------------------------------

#: the row-wise optimizers a table takes, as the cyclic-scheduler tests build them
CYCLIC_OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.5}), "adagrad": (torch.optim.Adagrad, {"lr": 0.5}),
                     "sparseadam": (torch.optim.SparseAdam, {"lr": 0.05})}
CYCLIC_STEPS = 4


def cyclic_scheduler(kind: str, opt: torch.optim.Optimizer, cycle_momentum: bool) -> Any:
    sched = torch.optim.lr_scheduler
    if kind == "onecycle":
        return sched.OneCycleLR(opt, max_lr=0.4, total_steps=2 * CYCLIC_STEPS, cycle_momentum=cycle_momentum)
    return sched.CyclicLR(opt, base_lr=0.05, max_lr=0.4, step_size_up=2, cycle_momentum=cycle_momentum)


def cyclic_batch(step: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    ids, offsets, _ = bag_batch(0, step)
    return {"a": (ids, offsets), "b": (ids.flip(0), offsets)}


def cyclic_loss(out: dict[str, torch.Tensor], step: int) -> torch.Tensor:
    target = bag_batch(0, step)[2]
    return ((out["a"] - target) ** 2 + (out["b"] + target) ** 2).mean()


def cyclic_groups(opt: torch.optim.Optimizer) -> list[tuple]:
    return [(g["lr"], g.get("momentum"), g.get("betas")) for g in opt.param_groups]


def cyclic_collection(name: str, optimizer: str, kind: str, cycle_momentum: bool) -> dict:
    """A collection of two sum bags (one sync trainer) whose ps_optimizer ``kind`` (OneCycleLR,
    CyclicLR) drives: the error building the scheduler (``(type name, message)``) or, trained
    ``CYCLIC_STEPS`` steps, the error of the first step() that raised, or the rows after and
    each step's settings (lr, momentum, betas per table)."""
    from remote_module.ps import ShardedEmbeddingBag, ShardedEmbeddingBagCollection

    tables = {}
    for k in ("a", "b"):
        bag = ShardedEmbeddingBag(ROWS, DIM, ["ps0", "ps1"], name=f"{name}-{k}", mode="sum", ps_mode="sync",
                                  num_trainers=1, optimizer=CYCLIC_OPTIMIZERS[optimizer],
                                  min_block_size=ROWS // 2 * DIM)
        bag.load_state_dict({"weight": initial_rows()})
        tables[k] = bag
    ebc = ShardedEmbeddingBagCollection(tables)
    try:
        sched = cyclic_scheduler(kind, ebc.ps_optimizer, cycle_momentum)
    except Exception as exc:  # noqa: BLE001 (its type is what the test checks)
        return {"scheduler_error": (type(exc).__name__, str(exc))}
    settings = []
    for k in range(CYCLIC_STEPS):
        cyclic_loss(ebc(cyclic_batch(k)), k).backward()
        settings.append(cyclic_groups(ebc.ps_optimizer))
        try:
            ebc.step()
        except Exception as exc:  # noqa: BLE001
            return {"step_error": (type(exc).__name__, str(exc)), "settings": settings}
        sched.step()
    ebc.flush()
    return {"rows": {k: t.state_dict()["weight"] for k, t in tables.items()}, "settings": settings}


# ---- a sync step refused: the trainers' lrs disagree for one step --------------------------------

REFUSED_STEPS, REFUSED_AT = 5, 2  # steps trained, and the one whose lrs disagree (trainer1 halves its lr)
REFUSED_LR = 0.5


def refused_step(name: str, trainer: int, where: str) -> dict:
    """Two sync trainers of a sum bag (``where``: alone, "collection": two in a collection,
    "psmodel": one in a PSModel with a Linear after it) on ps0 and ps1; at batch REFUSED_AT
    trainer1's table lr is half trainer0's, so the servers refuse that step. A forward that
    raises a ValueError is retried (the trainer sets its lr back first); the errors, each with
    the batch it came at, and the values after (the timeouts are hang guards: a stalled job
    fails by them, as the error it is)."""
    from torch import nn

    from remote_module.ps import PSModel, ShardedEmbeddingBag, ShardedEmbeddingBagCollection

    torch.manual_seed(0)
    names = ("a", "b") if where == "collection" else ("a",)
    tables = {}
    for k in names:
        tables[k] = ShardedEmbeddingBag(ROWS, DIM, ["ps0", "ps1"], name=f"{name}-{k}", mode="sum", ps_mode="sync",
                                        num_trainers=2, optimizer=(torch.optim.SGD, {"lr": REFUSED_LR}),
                                        min_block_size=ROWS // 2 * DIM, timeout=HANG_S)
        tables[k].load_state_dict({"weight": initial_rows()})
    if where == "collection":
        model = ShardedEmbeddingBagCollection(tables)
        groups = model.ps_optimizer.param_groups

        def loss_of(k: int) -> torch.Tensor:
            ids, offsets, target = bag_batch(trainer, k)
            out = model({"a": (ids, offsets), "b": (ids.flip(0), offsets)})
            return ((out["a"] - target) ** 2 + (out["b"] + target) ** 2).mean()
    elif where == "psmodel":
        module = nn.Module()
        torch.manual_seed(1)
        module.a, module.lin = tables["a"], nn.Linear(DIM, DIM)
        module.forward = lambda i, o: module.lin(module.a(i, o))  # type: ignore[method-assign]
        model = PSModel(module, ["ps0", "ps1"], name=f"{name}-m", num_trainers=2, ps_mode="sync",
                        optimizer=(torch.optim.SGD, {"lr": 0.1}), min_block_size=4, timeout=HANG_S)
        groups = tables["a"].ps_optimizer.param_groups

        def loss_of(k: int) -> torch.Tensor:
            ids, offsets, target = bag_batch(trainer, k)
            return ((model(ids, offsets) - target) ** 2).mean()
    else:
        model = tables["a"]
        groups = model.ps_optimizer.param_groups

        def loss_of(k: int) -> torch.Tensor:
            ids, offsets, target = bag_batch(trainer, k)
            return ((model(ids, offsets) - target) ** 2).mean()

    errors = []
    k = 0
    try:
        while k < REFUSED_STEPS:
            for group in groups:
                group["lr"] = REFUSED_LR / 2 if (trainer == 1 and k == REFUSED_AT) else REFUSED_LR
            try:
                loss = loss_of(k)
            except ValueError as exc:  # (its lr is set back above before the retry)
                errors.append((k, str(exc)))
                if len(errors) > 3:
                    raise
                continue
            loss.backward()
            model.step()
            k += 1
        with torch.no_grad():
            loss_of(0)  # (sync: waits for the last step)
    except Exception as exc:  # noqa: BLE001 (a stalled job: returned to the test, which fails)
        return {"fatal": f"{type(exc).__name__}: {exc}", "errors": errors}
    values = {k: t.state_dict()["weight"].clone() for k, t in tables.items()}
    if where == "psmodel":
        values.update({f"lin.{k}": v.detach().clone() for k, v in module.lin.state_dict().items()})
    return {"errors": errors, "values": values}


def last_step_refused(name: str, trainer: int, how: str) -> dict:
    """Two sync trainers of a sum bag whose last step the servers refuse (trainer1 halves its lr
    at it), then a checkpoint ends the job (``how``: "state_dict", "optimizer_state_dict";
    "collection": the bag in a collection, whose state_dict()): what it raised (once), and the
    rows after it and before the refused step."""
    from remote_module.ps import ShardedEmbeddingBag, ShardedEmbeddingBagCollection

    table = ShardedEmbeddingBag(ROWS, DIM, ["ps0", "ps1"], name=name, mode="sum", ps_mode="sync", num_trainers=2,
                                optimizer=(torch.optim.SGD, {"lr": REFUSED_LR}), min_block_size=ROWS // 2 * DIM,
                                timeout=HANG_S)
    table.load_state_dict({"weight": initial_rows()})
    model = ShardedEmbeddingBagCollection({"a": table}) if how == "collection" else table
    before = None
    for k in range(REFUSED_STEPS):
        last = k == REFUSED_STEPS - 1
        table.ps_optimizer.param_groups[0]["lr"] = REFUSED_LR / 2 if (trainer == 1 and last) else REFUSED_LR
        if last:
            before = table.state_dict()["weight"].clone()
        ids, offsets, target = bag_batch(trainer, k)
        out = model({"a": (ids, offsets)})["a"] if how == "collection" else model(ids, offsets)
        ((out - target) ** 2).mean().backward()
        model.step()
    raised = []
    for _ in range(2):  # (told once: the second call goes on)
        try:
            table.optimizer_state_dict() if how == "optimizer_state_dict" else model.state_dict()
        except ValueError as exc:
            raised.append(str(exc))
    return {"raised": raised, "before": before, "after": table.state_dict()["weight"].clone()}
