"""What tests/ps/test_table_training.py runs on its trainers: tables trained as torch trains a
local embedding (zero_grad through containers and optimizers, steps without gradients,
checkpoints continued, DDP and local optimizers beside the tables' grad markers), and the
warning of a table whose gradients are never pushed. Each returns what happened; pytest
compares it with plain torch (tests/ps/test_table_training.py holds the references)."""

from __future__ import annotations

import datetime
import warnings
from typing import Any

import torch
from torch import nn

from tests.ps._embedding_edge_cases_remote import table, weights

#: per step, the ids looked up (``None``: no lookup, so no gradient); rows 0-9 live on ps0, 10-19
#: on ps1 (tests/ps/_embedding_edge_cases_remote.table), so some steps touch one server only
SCHEDULE: list[list[int] | None] = [[1, 15], None, [16, 17], [2], None, None, [3, 15, 3], [18], None, [1, 19]]


def train(emb: nn.Module, schedule: list, step: Any, zero_grad: Any) -> None:
    """One step per entry of ``schedule``: zero_grad, a lookup and backward if it has ids, step."""
    for ids in schedule:
        zero_grad()
        if ids is not None:
            emb(torch.tensor(ids)).pow(2).sum().backward()
        step()


def local(optimizer: tuple) -> tuple[nn.Embedding, torch.optim.Optimizer]:
    emb = nn.Embedding(20, 3, sparse=True, _weight=weights(0))
    return emb, optimizer[0](emb.parameters(), **optimizer[1])


# ---- steps without gradients -------------------------------------------------------------------------


def steps_without_gradients(name: str, mode: str, optimizer: tuple) -> torch.Tensor:
    """A table trained on SCHEDULE in ``mode`` (half_async applying every push, geo pushing
    every 3 steps); its rows as the servers hold them."""
    t = table(name, ps_mode=mode, optimizer=optimizer, half_async_merge_every=1, geo_push_every=3)
    train(t, SCHEDULE, t.step, t.zero_grad)
    return t.state_dict()["weight"]


def sync_trainer(name: str, optimizer: tuple, schedule: list) -> torch.Tensor:
    """One of two trainers of a sync table, stepping ``schedule`` (all trainers step every
    step; a ``None`` entry: no gradient this step)."""
    t = table(name, ps_mode="sync", num_trainers=2, optimizer=optimizer, seed=None)
    train(t, schedule, t.step, t.zero_grad)
    return t.state_dict()["weight"]


def load_rows(name: str, optimizer: tuple) -> bool:
    """Load weights(0) into the 2-trainer sync table ``name`` (before its trainers step)."""
    table(name, ps_mode="sync", num_trainers=2, optimizer=optimizer, keep=False)
    return True


# ---- checkpoints continued ---------------------------------------------------------------------------


def checkpointed(name: str, mode: str, optimizer: tuple, first: list, then: list,
                 checkpoint: dict | None = None) -> dict:
    """Train a table in ``mode`` on ``first``, take a checkpoint (rows and optimizer state),
    train on ``then``; or (``checkpoint`` given) load it into a new table and train on ``then``.
    The checkpoint and the rows at the end."""
    kwargs = dict(ps_mode=mode, optimizer=optimizer, half_async_merge_every=1, geo_push_every=2)
    if checkpoint is None:
        t = table(name, **kwargs)
        train(t, first, t.step, t.zero_grad)
        checkpoint = {"rows": t.state_dict(), "optim": t.optimizer_state_dict()}
    else:
        t = table(name, seed=None, **kwargs)
        t.load_state_dict(checkpoint["rows"])
        t.load_optimizer_state_dict(checkpoint["optim"])
    train(t, then, t.step, t.zero_grad)
    return {"checkpoint": checkpoint, "rows": t.state_dict()["weight"]}


# ---- zero_grad through containers and optimizers -----------------------------------------------------


class Clicks(nn.Module):
    """A sharded bag (or a local sparse one) feeding a Linear: a model holding a table."""

    def __init__(self, bag: nn.Module) -> None:
        super().__init__()
        self.bag = bag
        torch.manual_seed(0)
        self.dense = nn.Linear(3, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.dense(self.bag(ids)).squeeze(1)


BAGS = [torch.tensor([[1, 15], [2, 3]]), torch.tensor([[16, 4], [4, 5]]), torch.tensor([[6, 17], [18, 1]])]


def zero_grad_run(model: nn.Module, table_step: Any, how: str) -> None:
    """A loop over BAGS where the first backward is discarded by ``zero_grad`` of ``how``
    (``"module"``: the model's; ``"container"``: an ``nn.ModuleList`` holding the model;
    ``"optimizer"``: SGD over ``model.parameters()``), then two steps; a backward discarded
    just before a step that finds nothing; the dense part trains by the same SGD."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    zero = {"module": model.zero_grad, "container": nn.ModuleList([model]).zero_grad, "optimizer": opt.zero_grad}[how]
    model(BAGS[0]).pow(2).sum().backward()
    zero()  # the backward above is discarded: the table must not step it
    for ids in BAGS[1:]:
        model(ids).pow(2).sum().backward()
        opt.step()
        table_step()
        zero()
    model(BAGS[0]).sum().backward()
    zero()
    table_step()  # nothing left: no optimizer step either


def zero_grad_sharded(name: str, how: str) -> dict:
    model = Clicks(table(name, bag="sum", optimizer=(torch.optim.SGD, {"lr": 0.5})))
    zero_grad_run(model, model.bag.step, how)
    return {"rows": model.bag.state_dict()["weight"], "dense": model.dense.state_dict()}


# ---- local optimizers and DDP beside the tables' grad markers -----------------------------------------


def local_optimizer_run(name: str, optimizer: tuple) -> dict:
    """A model holding a table, trained by a local ``optimizer`` over ``model.parameters()``
    (which holds the table's zero-size marker) and the table's own SGD."""
    model = Clicks(table(name, bag="sum", optimizer=(torch.optim.SGD, {"lr": 0.5})))
    opt = optimizer[0](model.parameters(), **optimizer[1])
    for ids in BAGS * 2:
        opt.zero_grad()
        model(ids).pow(2).sum().backward()
        nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        opt.step()
        model.bag.step()
    return {"rows": model.bag.state_dict()["weight"], "dense": model.dense.state_dict(),
            "params": [n for n, _ in model.named_parameters()], "state_keys": sorted(model.state_dict())}


def ddp_inside_run(name: str, rank: int, store_path: str) -> dict:
    """Trainer ``rank`` of 2: DDP (gloo) around a whole model holding a table (async), so the
    table's marker is one of DDP's parameters; an SGD of the DDP module's parameters; each
    trainer looks up rows of its own parity."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    # (a collective that hangs fails within 2 minutes naming itself, before the world's own
    # 300 s guard names only the call)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    try:
        bag = table(name, bag="sum", num_trainers=2, optimizer=(torch.optim.SGD, {"lr": 0.5}),
                    seed=0 if rank == 0 else None)
        dist.barrier()  # trainer0 loaded the rows
        model = DDP(Clicks(bag))
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=0.01)
        for ids in BAGS:
            opt.zero_grad()
            model(ids // 2 * 2 + rank).pow(2).sum().backward()
            opt.step()
            bag.step()
        bag.flush()  # (the last step returned with its pushes in flight: landed before the barrier)
        dist.barrier()  # both trainers' pushes are in
        return {"rows": bag.state_dict()["weight"], "dense": model.module.dense.state_dict()}
    finally:
        dist.destroy_process_group()


# ---- the warning of gradients never pushed -----------------------------------------------------------


def unpushed_warnings(name: str, case: str) -> dict:
    """Run ``case`` with a table in a model; the table warnings caught, and the rows."""
    bag = table(name, bag="sum", optimizer=(torch.optim.SGD, {"lr": 0.5}))
    model = Clicks(bag)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if case == "forgotten step":  # a ported DLRM loop: model.parameters() holds no table rows
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for ids in BAGS * 2:
                opt.zero_grad()
                model(ids).pow(2).sum().backward()
                opt.step()
        elif case == "forgotten step, dense optimizer":
            opt = torch.optim.Adam(model.dense.parameters(), lr=0.1)
            for ids in BAGS:
                opt.zero_grad()
                model(ids).pow(2).sum().backward()
                opt.step()
            with torch.no_grad():
                model(BAGS[0])  # an eval lookup does not warn
            model(BAGS[0])
        elif case == "accumulation":  # 4 backward passes per step, the table stepped after the optimizer
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(3):
                opt.zero_grad()
                for ids in BAGS + BAGS[:1]:
                    model(ids).pow(2).sum().backward()
                opt.step()
                bag.step()
        elif case == "demo loop":  # as remote_module/demos/dlrm.py: zero_grad, backward, step, table.step
            opt = torch.optim.Adam(model.dense.parameters(), lr=0.1)
            for ids in BAGS * 2:
                opt.zero_grad()
                model(ids).pow(2).sum().backward()
                opt.step()
                bag.step()
        elif case == "many backward passes":  # no local optimizer: told after 10 passes without a step
            for _ in range(11):
                bag(BAGS[0]).sum().backward()
            bag(BAGS[0])
            bag(BAGS[0])
        elif case == "long accumulation":  # no local optimizer, 9 passes then a step: silent
            for _ in range(2):
                for _ in range(9):
                    bag(BAGS[0]).sum().backward()
                bag.step()
            bag(BAGS[0])
        elif case == "discarded by zero_grad":  # gradients inspected, then discarded: nothing to push
            for _ in range(12):
                model(BAGS[0]).pow(2).sum().backward()
                model.zero_grad()
            model(BAGS[0])
        elif case == "frozen":  # requires_grad_(False): nothing recorded, nothing to warn about
            model.requires_grad_(False)
            model.dense.requires_grad_(True)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for ids in BAGS * 2:
                opt.zero_grad()
                out = model(ids)
                out.pow(2).sum().backward()
                opt.step()
            frozen_out = bag(BAGS[0])
        else:
            raise ValueError(case)
    got = [str(w.message) for w in caught if "never pushed" in str(w.message)]
    out = {"warnings": got, "categories": [w.category.__name__ for w in caught if "never pushed" in str(w.message)],
           "files": [w.filename for w in caught if "never pushed" in str(w.message)],
           "rows": bag.state_dict()["weight"]}
    if case == "frozen":
        out["frozen_requires_grad"] = frozen_out.requires_grad
        out["held"] = len(bag._held) + len(bag._fresh)
    return out


def scheduled_lr(name: str, case: str) -> dict:
    """A ported DLRM loop with an LR scheduler (dlrm's LRPolicyScheduler decays every group of an
    optimizer over ``model.parameters()``): the lr warnings caught."""
    bag = table(name, bag="sum", optimizer=(torch.optim.SGD, {"lr": 0.5}))
    model = Clicks(bag)
    # "two tables": a second table in the same optimizer group (a model's, a collection's tables)
    other = None
    if case == "two tables":
        other = table(f"{name}-other", bag="sum", optimizer=(torch.optim.SGD, {"lr": 0.5}))
    model.other = other
    params = model.dense.parameters() if case == "dense only" else model.parameters()
    opt = torch.optim.SGD(params, lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5 if case != "constant" else 1.0)
    rows_sched = torch.optim.lr_scheduler.StepLR(bag.ps_optimizer, step_size=1, gamma=0.5) if case == "both" else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for ids in BAGS * 2:
            opt.zero_grad()
            (model(ids).pow(2).sum() + (0 if other is None else other(ids).pow(2).sum())).backward()
            opt.step()
            bag.step()
            if other is not None:
                other.step()
            sched.step()
            if rows_sched is not None:  # (the text-classification tutorial's port: both scheduled)
                rows_sched.step()
    return {"warnings": [str(w.message) for w in caught if "lr" in str(w.message)],
            "categories": [w.category.__name__ for w in caught if "lr" in str(w.message)],
            "files": [w.filename for w in caught if "lr" in str(w.message)]}


# ---- a model moved to another dtype; a copy of a sync table --------------------------------------------


def in_dtype(name: str, bag: str | None, dtype: torch.dtype) -> dict:
    """A table (``bag``: a ShardedEmbeddingBag of that pooling) under a Linear, the whole model
    cast to ``dtype`` as ``model.to(dtype)`` casts it, trained two SGD steps: each output's
    dtype and value, the Linear's gradient and the rows after."""
    t = table(name, bag=bag, optimizer=(torch.optim.SGD, {"lr": 0.5}))
    model = nn.Sequential(t, nn.Linear(3, 1))
    nn.init.normal_(model[1].weight, generator=torch.Generator().manual_seed(0))
    nn.init.zeros_(model[1].bias)
    model = model.to(dtype)
    return {**_two_steps(model, t.step), "rows": t.state_dict()["weight"]}


def local_in_dtype(bag: str | None, dtype: torch.dtype) -> dict:
    """:func:`in_dtype` with a local sparse ``nn.Embedding`` / ``nn.EmbeddingBag`` and SGD."""
    emb = (nn.Embedding(20, 3, sparse=True, _weight=weights(0)) if bag is None  # (max: no sparse; SGD alike)
           else nn.EmbeddingBag(20, 3, mode=bag, sparse=bag != "max", _weight=weights(0)))
    model = nn.Sequential(emb, nn.Linear(3, 1))
    nn.init.normal_(model[1].weight, generator=torch.Generator().manual_seed(0))
    nn.init.zeros_(model[1].bias)
    model = model.to(dtype)
    opt = torch.optim.SGD(emb.parameters(), lr=0.5)
    return {**_two_steps(model, opt.step), "rows": emb.weight.detach()}


def _two_steps(model: nn.Module, step: Any) -> dict:
    """Two steps of :func:`in_dtype`'s loop on ``model`` (an embedding under a Linear), with
    ``step`` stepping the embedding: each output and the Linear's gradient."""
    ids = torch.tensor([[1, 15], [2, 1]])
    outs, grads = [], []
    for _ in range(2):
        model.zero_grad()
        out = model(ids)
        outs.append(out.detach())
        out.pow(2).sum().backward()
        grads.append(model[1].weight.grad.clone())
        step()
    return {"outs": outs, "grads": grads}


def copied_sync_table(name: str) -> dict:
    """A sync table and its ``copy.deepcopy``: the original steps row 1, the copy tries to step
    row 2 (refused: one trainer, one object), the original steps row 3."""
    import copy

    t = table(name, ps_mode="sync")
    c = copy.deepcopy(t)
    t(torch.tensor([1])).sum().backward()
    t.step()
    try:
        c(torch.tensor([2])).sum().backward()
        c.step()
        copy_error = None
    except Exception as exc:
        copy_error = f"{type(exc).__name__}: {exc}"
    t(torch.tensor([3])).sum().backward()
    t.step()
    return {"copy_error": copy_error, "rows": t.state_dict()["weight"]}


# ---- a PSModel step that failed in a table, retried --------------------------------------------------------


def refuse_push(*args) -> None:
    raise TimeoutError("ps1 did not answer (injected)")


def psmodel_step_retried(name: str) -> dict:
    """A sync PSModel holding a sync bag (SGD lr 0.5) and a Linear (SGD lr 0.1), 3 steps; the
    table's first push of step 1 fails (as a timed-out server fails it) and step() is called
    again. The rows, the dense values and each server's dense step count after."""
    from remote_module.ps import PSModel

    bag = table(name + "-bag", bag="sum", ps_mode="sync", optimizer=(torch.optim.SGD, {"lr": 0.5}))
    model = PSModel(Clicks(bag), ["ps0", "ps1"], name=name, num_trainers=1, ps_mode="sync", min_block_size=1)
    plan, failed = bag._push_plan, []

    def failing_once():
        # the table's pushes of this step fail on its servers, as a timed-out server fails them
        got = plan()
        if got is None or not failed or failed[-1]:
            return got
        failed[-1] = True
        return got._replace(calls=[(server, refuse_push, ()) for server, _, _ in got.calls])

    bag._push_plan = failing_once
    for i, ids in enumerate(BAGS):
        model(ids).pow(2).sum().backward()
        if i == 1:
            failed.append(False)
            try:
                model.step()  # (returns with its pushes in flight: flush() lands them, raising)
                model.flush()
            except TimeoutError:
                pass
        model.step()  # (i == 1: the retry)
    out = {"rows": bag.state_dict()["weight"], "dense": {k: v.clone() for k, v in model.state_dict().items()
                                                          if k.startswith("dense.")},
           "versions": [s["version"] for s in model.stats().values()], "failed": failed}
    # a failed step dropped (zero_grad), not retried: the next step() is a whole one
    model(BAGS[0]).sum().backward()
    failed.append(False)
    try:
        model.step()
        model.flush()
    except TimeoutError:
        pass
    model.zero_grad()
    model(BAGS[0]).sum().backward()
    model.step()
    out["versions_after"] = [s["version"] for s in model.stats().values()]
    return out


def local_psmodel_steps() -> dict:
    """:func:`psmodel_step_retried` as plain torch (no failure)."""
    model = Clicks(nn.EmbeddingBag(20, 3, mode="sum", sparse=True, _weight=weights(0)))
    dense = torch.optim.SGD(model.dense.parameters(), lr=0.1)
    rows = torch.optim.SGD(model.bag.parameters(), lr=0.5)
    for ids in BAGS:
        model.zero_grad()
        model(ids).pow(2).sum().backward()
        dense.step()
        rows.step()
    return {"rows": model.bag.weight.detach(), "dense": {f"dense.{k}": v for k, v in model.dense.state_dict().items()}}


# ---- gradients that torch does not write to .grad -----------------------------------------------------------


def grads_not_accumulated(model: nn.Module, bag: nn.Module, table_step: Any) -> None:
    """Steps where some gradients are not ``.grad``'s: ``torch.autograd.grad`` of the loss with
    respect to ``model.parameters()`` (a gradient norm to log), then a backward; a backward
    with ``inputs=`` the dense parameters only. SGD over the dense part, ``table_step`` after."""
    opt = torch.optim.SGD(model.dense.parameters(), lr=0.1)
    for ids in BAGS:
        opt.zero_grad()
        loss = model(ids).pow(2).sum()
        torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad], retain_graph=True)
        loss.backward()
        opt.step()
        table_step()
    opt.zero_grad()
    model(BAGS[0]).pow(2).sum().backward(inputs=list(model.dense.parameters()))
    opt.step()
    table_step()


def grads_not_accumulated_sharded(name: str) -> dict:
    bag = table(name, bag="sum", optimizer=(torch.optim.SGD, {"lr": 0.5}))
    model = Clicks(bag)
    grads_not_accumulated(model, bag, bag.step)
    return {"rows": bag.state_dict()["weight"], "dense": model.dense.state_dict()}


def grads_not_accumulated_local() -> dict:
    model = Clicks(nn.EmbeddingBag(20, 3, mode="sum", sparse=True, _weight=weights(0)))
    rows = torch.optim.SGD(model.bag.parameters(), lr=0.5)

    def table_step() -> None:
        rows.step()
        rows.zero_grad()

    grads_not_accumulated(model, model.bag, table_step)
    return {"rows": model.bag.weight.detach(), "dense": model.dense.state_dict()}


class OnlyTables(nn.Module):
    """A model whose only parameters are a sharded table's (its grad marker)."""

    def __init__(self, bag: nn.Module) -> None:
        super().__init__()
        self.bag = bag

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.bag(ids)


def geo_only_tables(name: str) -> dict:
    """A geo PSModel over a model that holds a geo bag and nothing else (no dense parameter):
    BAGS trained (one trainer: geo is local training), its optimizer state saved and loaded;
    the rows, and the same as a local sparse bag with SGD."""
    from remote_module.ps import PSModel

    bag = table(name + "-bag", bag="sum", ps_mode="geo", geo_push_every=1, optimizer=(torch.optim.SGD, {"lr": 0.5}))
    model = PSModel(OnlyTables(bag), ["ps0", "ps1"], name=name, num_trainers=1, ps_mode="geo")
    for ids in BAGS:
        model(ids).pow(2).sum().backward()
        model.step()
    model.load_optimizer_state_dict(model.optimizer_state_dict())
    local = nn.EmbeddingBag(20, 3, mode="sum", sparse=True, _weight=weights(0))
    opt = torch.optim.SGD(local.parameters(), lr=0.5)
    for ids in BAGS:
        opt.zero_grad()
        local(ids).pow(2).sum().backward()
        opt.step()
    return {"rows": bag.state_dict()["weight"], "local": local.weight.detach()}


def cast_and_back(name: str, bag: str | None, dtype: torch.dtype) -> dict:
    """:func:`in_dtype`'s model in float32, two steps, cast to ``dtype`` and back to float32
    (torch gives the grad_marker a new AccumulateGrad at each cast), two steps more."""
    t = table(name, bag=bag, optimizer=(torch.optim.SGD, {"lr": 0.5}))
    model = nn.Sequential(t, nn.Linear(3, 1))
    nn.init.normal_(model[1].weight, generator=torch.Generator().manual_seed(0))
    nn.init.zeros_(model[1].bias)
    _two_steps(model, t.step)
    model.to(dtype).float()
    return {**_two_steps(model, t.step), "rows": t.state_dict()["weight"]}


def swapped_on_conversion(name: str, bag: str | None, local: bool = False) -> dict:
    """:func:`cast_and_back`'s loop with ``model.float()`` of the float32 model under
    ``torch.__future__.set_swap_module_params_on_conversion(True)`` in the middle: torch swaps a
    new Parameter of the same data into the grad_marker (its hooks and AccumulateGrad left
    with the old one). ``local``: the same with a local module and SGD."""
    emb = (nn.Embedding(20, 3, sparse=True, _weight=weights(0)) if bag is None
           else nn.EmbeddingBag(20, 3, mode=bag, sparse=bag != "max", _weight=weights(0))) if local \
        else table(name, bag=bag, optimizer=(torch.optim.SGD, {"lr": 0.5}))
    model = nn.Sequential(emb, nn.Linear(3, 1))
    nn.init.normal_(model[1].weight, generator=torch.Generator().manual_seed(0))
    nn.init.zeros_(model[1].bias)
    first = _two_steps(model, torch.optim.SGD(emb.parameters(), lr=0.5).step if local else emb.step)
    model.zero_grad()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.float()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    second = _two_steps(model, torch.optim.SGD(emb.parameters(), lr=0.5).step if local else emb.step)
    return {"outs": first["outs"] + second["outs"], "grads": first["grads"] + second["grads"],
            "rows": emb.weight.detach() if local else emb.state_dict()["weight"]}


def marker_hooks_over_functional_calls(name: str, rounds: int = 4) -> list[int]:
    """A table called through ``torch.func.functional_call`` (its grad_marker given as another
    tensor) and plainly, in turn, a step after each: the hooks on its grad_marker per round."""
    t = table(name, bag="sum", optimizer=(torch.optim.SGD, {"lr": 0.5}))
    ids, offsets = torch.tensor([1, 15]), torch.tensor([0, 1])
    counts = []
    for _ in range(rounds):
        given = {k: v.detach().clone().requires_grad_() for k, v in t.named_parameters()}
        torch.func.functional_call(t, given, (ids, offsets)).sum().backward()
        t.step()
        t(ids, offsets).sum().backward()
        t.step()
        counts.append(len(t.grad_marker._post_accumulate_grad_hooks or {}))
    return counts


def local_cast_and_back(bag: str | None, dtype: torch.dtype) -> dict:
    """:func:`cast_and_back` with :func:`local_in_dtype`'s local module."""
    emb = (nn.Embedding(20, 3, sparse=True, _weight=weights(0)) if bag is None
           else nn.EmbeddingBag(20, 3, mode=bag, sparse=bag != "max", _weight=weights(0)))
    model = nn.Sequential(emb, nn.Linear(3, 1))
    nn.init.normal_(model[1].weight, generator=torch.Generator().manual_seed(0))
    nn.init.zeros_(model[1].bias)
    opt = torch.optim.SGD(emb.parameters(), lr=0.5)
    _two_steps(model, opt.step)
    model.to(dtype).float()
    return {**_two_steps(model, opt.step), "rows": emb.weight.detach()}
