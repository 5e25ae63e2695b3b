"""What the trainers (and servers) run in tests/ps/test_embedding.py."""

from __future__ import annotations

import datetime

import torch
from torch import nn

_objects: dict[str, object] = {}


def local_bag(seed: int, mode: str, padding_idx=None) -> nn.EmbeddingBag:
    torch.manual_seed(seed)
    return nn.EmbeddingBag(200, 4, mode=mode, padding_idx=padding_idx)


def batches(seed: int, n: int, with_weights: bool, pad: int | None = None):
    """(ids, offsets, per_sample_weights, target) for 4 bags (the second empty); with ``pad``,
    the first bag holds the padding id and the last bag nothing else."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 200, (15,), generator=g)
        if pad is not None:
            ids[1] = pad
            ids[9:] = pad
        offsets = torch.tensor([0, 4, 4, 9])
        psw = torch.rand(15, generator=g) if with_weights else None
        target = torch.randn(4, 4, generator=g)
        out.append((ids, offsets, psw, target))
    return out


def bag_run(name: str, mode: str, padding_idx, optimizer: tuple, steps: int, ps_mode: str = "async",
            num_trainers: int = 1, data_seed: int = 1, servers: tuple = ("ps0", "ps1")) -> dict:
    """Create a sharded bag loaded with local_bag(0, ...)'s weights, run ``steps`` training steps
    on batches(data_seed), return every output, the output of a lookup of the same batch under
    ``no_grad`` after each step, and the final weights."""
    from remote_module.ps import ShardedEmbeddingBag

    bag = ShardedEmbeddingBag(200, 4, list(servers), name=name, mode=mode, padding_idx=padding_idx,
                              optimizer=optimizer, min_block_size=200, ps_mode=ps_mode, num_trainers=num_trainers)
    bag.load_state_dict(local_bag(0, mode, padding_idx).state_dict())
    outs, evals = [], []
    for ids, offsets, psw, target in batches(data_seed, steps, mode == "sum", padding_idx):
        out = bag(ids, offsets, psw)
        outs.append(out.detach())
        ((out - target) ** 2).sum().backward()
        bag.step()
        with torch.no_grad():  # sync: waits for the step every trainer pushed
            evals.append(bag(ids, offsets, psw))
    return {"outs": outs, "evals": evals, "weight": bag.state_dict()["weight"], "pushed": bag.pushed_bytes}


def sparsity(name: str) -> dict:
    from remote_module.ps import ShardedEmbedding

    emb = ShardedEmbedding(1_000_000, 16, ["ps0", "ps1"], name=name, init="lazy")
    g = torch.Generator().manual_seed(0)
    sent = []
    for _ in range(3):
        out = emb(torch.randint(0, 1_000_000, (1000,), generator=g))
        out.sum().backward()
        before = emb.pushed_bytes
        emb.step()
        sent.append(emb.pushed_bytes - before)
    return {"per_step": sent, "table_bytes": 1_000_000 * 16 * 4}


def lazy_train(name: str, steps: int) -> int:
    from remote_module.ps import ShardedEmbedding

    emb = ShardedEmbedding(100_000_000, 16, ["ps0", "ps1"], name=name, init="lazy",
                           optimizer=(torch.optim.Adagrad, {"lr": 0.1}))
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        out = emb(torch.randint(0, 100_000_000, (512,), generator=g))
        out.pow(2).sum().backward()
        emb.step()
    emb.flush()  # (the last step's pushes landed before the servers are measured)
    return steps


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def reslice_run(name: str, servers: list, steps: int, start: int, checkpoint=None) -> dict:
    """Train a Adagrad bag on ``servers`` for ``steps`` steps of batches(5) from ``start``,
    optionally after loading ``checkpoint`` (weights + optimizer state); return the new checkpoint."""
    from remote_module.ps import ShardedEmbeddingBag

    bag = ShardedEmbeddingBag(200, 4, servers, name=name, mode="sum", min_block_size=100,
                              optimizer=(torch.optim.Adagrad, {"lr": 0.2}))
    if checkpoint is None:
        bag.load_state_dict(local_bag(0, "sum").state_dict())
    else:
        bag.load_state_dict({"weight": checkpoint["weight"]})
        bag.load_optimizer_state_dict(checkpoint["optim"])
    data = batches(5, start + steps, True)[start:]
    for ids, offsets, psw, target in data:
        out = bag(ids, offsets, psw)
        ((out - target) ** 2).sum().backward()
        bag.step()
    return {"weight": bag.state_dict()["weight"], "optim": bag.optimizer_state_dict(),
            "servers": sorted({s for _, _, s in bag._ranges})}


def half_async_run(name: str) -> dict:
    from remote_module.ps import ShardedEmbedding

    emb = ShardedEmbedding(50, 2, ["ps0", "ps1"], name=name, ps_mode="half_async", min_block_size=50,
                           half_async_merge_every=3, half_async_merge_s=3600.0,  # (by count only)
                           optimizer=(torch.optim.SGD, {"lr": 1.0}))
    ids = torch.tensor([1, 30])
    with torch.no_grad():
        start = emb(ids).clone()
    seen = []
    for k in range(3):
        emb(ids).sum().mul(k + 1).backward()  # gradient k + 1 on both rows
        emb.step()
        with torch.no_grad():
            seen.append(emb(ids).clone())
    return {"start": start, "seen": seen}


def geo_run(name: str, k: int, steps: int) -> dict:
    from remote_module.ps import ShardedEmbedding

    emb = ShardedEmbedding(50, 2, ["ps0", "ps1"], name=name, ps_mode="geo", min_block_size=50, geo_push_every=k,
                           optimizer=(torch.optim.SGD, {"lr": 0.5}))
    emb.load_state_dict({"weight": torch.arange(100, dtype=torch.float32).reshape(50, 2)})
    server = []
    for step in range(steps):
        out = emb(torch.tensor([3, 40, 3]))
        out.sum().backward()
        emb.step()
        # a new object of the table has cached nothing: its lookup reads the servers' rows
        # (state_dict() would push this trainer's deltas first)
        reader = ShardedEmbedding(50, 2, ["ps0", "ps1"], name=name, ps_mode="geo", min_block_size=50,
                                  geo_push_every=k, optimizer=(torch.optim.SGD, {"lr": 0.5}))
        with torch.no_grad():
            server.append(reader(torch.tensor([3, 40])).clone())
    return {"server": server}


class Clicks(nn.Module):
    """A sharded bag feeding a local linear layer: the smallest hybrid of table and dense part."""

    def __init__(self, bag: nn.Module) -> None:
        super().__init__()
        self.bag = bag
        torch.manual_seed(0)
        self.dense = nn.Linear(4, 1)

    def forward(self, ids, offsets):
        return self.dense(self.bag(ids, offsets)).squeeze(1)


def click_batches(seed: int, n: int, parity: int | None = None):
    """(ids, offsets, target) batches; with ``parity``, ids of that parity only (rows no other
    trainer touches)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 200, (12,), generator=g)
        if parity is not None:
            ids = ids // 2 * 2 + parity
        out.append((ids, torch.tensor([0, 3, 7, 7]), torch.randn(4, generator=g)))
    return out


def _table(name: str, mode: str, num_trainers: int, merge_every: int):
    from remote_module.ps import ShardedEmbeddingBag

    bag = ShardedEmbeddingBag(200, 4, ["ps0", "ps1"], name=name, mode="sum", ps_mode=mode, num_trainers=num_trainers,
                              optimizer=(torch.optim.SGD, {"lr": 0.1}), min_block_size=200, geo_push_every=1,
                              half_async_merge_every=merge_every)
    bag.load_state_dict(local_bag(0, "sum").state_dict())
    return bag


def psmodel_run(name: str, mode: str, steps: int) -> dict:
    """One trainer: a PSModel holding a sharded bag and a Linear (dense blocks on ps1, ps2), in
    ``mode``; the outputs and the final state_dict."""
    from remote_module.ps import PSModel

    model = PSModel(Clicks(_table(name + "-bag", mode, 1, 1)), ["ps1", "ps2"], name=name, num_trainers=1, ps_mode=mode,
                    optimizer=(torch.optim.SGD, {"lr": 0.1}), geo_push_every=1, half_async_merge_every=1)
    outs = []
    for ids, offsets, target in click_batches(3, steps):
        out = model(ids, offsets)
        outs.append(out.detach())
        ((out - target) ** 2).mean().backward()
        model.step()
    return {"outs": outs, "state": model.state_dict(), "optim": model.optimizer_state_dict()}


def ddp_run(name: str, mode: str, rank: int, store_path: str, steps: int) -> dict:
    """Trainer ``rank`` of 2: the Linear under DDP (gloo among the two trainers), the bag on the
    servers in ``mode``, each trainer on rows of its own parity; the final bag rows and Linear."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    # (a collective that hangs fails within 2 minutes naming itself, before the world's own
    # 300 s guard names only the call)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    try:
        model = Clicks(_table(name, mode, 2, 1))
        model.dense = DDP(model.dense)
        opt = torch.optim.SGD(model.dense.parameters(), lr=0.1)
        for ids, offsets, target in click_batches(10 + rank, steps, parity=rank):
            opt.zero_grad()
            ((model(ids, offsets) - target) ** 2).mean().backward()
            opt.step()
            model.bag.step()
        model.bag.flush()  # (the last step returned with its pushes in flight: landed before the barrier)
        dist.barrier()  # both trainers' last pushes are in before the rows are read
        return {"rows": model.bag.state_dict()["weight"], "dense": model.dense.module.state_dict()}
    finally:
        dist.destroy_process_group()


def form_inputs():
    """Inputs in the forms nn.Embedding / nn.EmbeddingBag take, and two they refuse."""
    g = torch.Generator().manual_seed(4)
    ids2d = torch.randint(0, 200, (3, 5), generator=g)
    ids2d[0, 1] = 2  # the padding id
    flat = torch.randint(0, 200, (15,), generator=g)
    return {"ids2d": ids2d, "flat": flat, "offsets": torch.tensor([0, 4, 4, 9]),
            "psw": torch.rand(15, generator=g)}


def local_forms():
    torch.manual_seed(5)
    emb = nn.Embedding(200, 4, padding_idx=2)
    bags = {mode: nn.EmbeddingBag(200, 4, mode=mode) for mode in ("sum", "mean", "max")}
    return emb, bags


def forms_run(name: str, local: bool = False) -> dict:
    """Lookups in every form, on the sharded modules (or, with ``local``, on local_forms()):
    outputs, the gradient of per_sample_weights, and the errors of refused calls."""
    from remote_module.ps import ShardedEmbedding, ShardedEmbeddingBag

    emb, bags = local_forms()
    if not local:
        sharded = ShardedEmbedding(200, 4, ["ps0", "ps1"], name=name + "-emb", padding_idx=2, min_block_size=200)
        sharded.load_state_dict(emb.state_dict())
        emb = sharded
        for mode in list(bags):
            bag = ShardedEmbeddingBag(200, 4, ["ps0", "ps1"], name=f"{name}-{mode}", mode=mode, min_block_size=200)
            bag.load_state_dict(bags[mode].state_dict())
            bags[mode] = bag
    x = form_inputs()
    out = {"emb": emb(x["ids2d"]).detach()}
    for mode, bag in bags.items():
        with torch.no_grad():
            out[f"{mode}-2d"] = bag(x["ids2d"])
            out[f"{mode}-offsets"] = bag(x["flat"], x["offsets"])
    psw = x["psw"].clone().requires_grad_(True)
    bags["sum"](x["flat"], x["offsets"], psw).pow(2).sum().backward()
    out["psw-grad"] = psw.grad
    errors = {}
    for what, call in (("psw with mean", lambda: bags["mean"](x["flat"], x["offsets"], x["psw"])),
                       ("2-d with offsets", lambda: bags["sum"](x["ids2d"], x["offsets"])),
                       ("1-d without offsets", lambda: bags["sum"](x["flat"]))):
        try:
            call()
            errors[what] = None
        except Exception as exc:  # noqa: BLE001 - the test compares them with torch's
            errors[what] = (type(exc).__name__, str(exc))
    out["errors"] = errors
    return out


def sync_stall(name: str, timeout: float) -> dict:
    """A sync table of 2 trainers where only this one steps: its next lookup must fail in time,
    naming what it waits for. ``timeout`` is set once the table is built and looked up (a
    loaded machine may take longer than it for those), before the step: the calls it is
    expected to end."""
    import time

    from remote_module.ps import ShardedEmbeddingBag

    bag = ShardedEmbeddingBag(200, 4, ["ps0", "ps1"], name=name, mode="sum", ps_mode="sync", num_trainers=2,
                              min_block_size=200)
    ids = torch.tensor([[1, 150]])
    bag(ids).sum().backward()
    bag.timeout = timeout
    bag.step()
    start = time.monotonic()
    try:
        bag(ids)
    except Exception as exc:  # noqa: BLE001 - returned to the test
        return {"ok": False, "type": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start}
    return {"ok": True, "seconds": time.monotonic() - start}


def geo_dropped_after_a_step(name: str, steps: int) -> dict:
    """A geo table (ps0, ps1; geo_push_every=2, SGD lr 0.5) trained ``steps`` steps of rows 3
    and 40 and dropped right after the last ``step()`` (a notebook cell building it again):
    the warnings its end gave, then the rows the servers hold, read by the table built again
    (it waits for the first one's push in flight)."""
    import gc
    import warnings

    from remote_module.ps import ShardedEmbeddingBag

    def build() -> ShardedEmbeddingBag:
        return ShardedEmbeddingBag(100, 2, ["ps0", "ps1"], name=name, mode="sum", ps_mode="geo",
                                   geo_push_every=2, min_block_size=2,
                                   optimizer=(torch.optim.SGD, {"lr": 0.5}))

    bag = build()
    bag.load_state_dict({"weight": torch.arange(200, dtype=torch.float32).reshape(100, 2)})
    for _ in range(steps):
        bag(torch.tensor([3, 40]), torch.tensor([0, 1])).sum().backward()
        bag.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del bag
        gc.collect()
    with torch.no_grad():
        rows = build()(torch.tensor([3, 40]), torch.tensor([0, 1]))
    return {"warned": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)], "rows": rows}


def collected_after_a_backward(name: str, mode: str) -> bool:
    """Whether a table that ran a forward, a backward and a step is freed once dropped (a
    notebook building it again each run must not keep every earlier one)."""
    import gc
    import weakref

    from remote_module.ps import ShardedEmbeddingBag

    bag = ShardedEmbeddingBag(100, 2, ["ps0", "ps1"], name=name, mode="sum", ps_mode=mode, min_block_size=2)
    bag(torch.tensor([3, 40]), torch.tensor([0, 1])).sum().backward()
    bag.step()
    bag.flush()
    ref = weakref.ref(bag)
    del bag
    gc.collect()
    return ref() is None
