"""What tests/ps/test_model_shard_checkpoints.py runs on its trainers: PSModels trained, saved
with ``save_shards`` (each dense server writing its own blocks) and loaded with
``load_shards``, beside the same models through ``state_dict()`` / ``optimizer_state_dict()``."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

IN, HIDDEN, OUT = 6, 8, 3

#: the models the tests train, by case: PSModel keyword arguments
CASES: dict[str, dict[str, Any]] = {
    "sgd-momentum-sync": {"ps_mode": "sync", "optimizer": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})},
    "adam-async": {"ps_mode": "async", "optimizer": (torch.optim.Adam, {"lr": 0.01})},
    # (every push merged at once: one trainer's run does not depend on a timer)
    "adam-half_async": {"ps_mode": "half_async", "optimizer": (torch.optim.Adam, {"lr": 0.01}),
                        "half_async_merge_every": 1},
    "sgd-momentum-async-dc_asgd": {"ps_mode": "async", "optimizer": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
                                   "dc_asgd": 0.5},
    # geo: the optimizer and the progress since the last push are the trainer's (its file)
    "adagrad-geo": {"ps_mode": "geo", "optimizer": (torch.optim.Adagrad, {"lr": 0.1}), "geo_push_every": 3},
}


def net(seed: int) -> nn.Module:
    """A small MLP with BatchNorm (its running statistics: buffers the trainer keeps)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


def model(name: str, servers: list[str], case: str, seed: int = 0, module: nn.Module | None = None) -> Any:
    """A PSModel of ``case`` (one trainer), its weights in blocks of 16 elements or more."""
    from remote_module.ps import PSModel

    return PSModel(net(seed) if module is None else module, servers, name=name, num_trainers=1, min_block_size=16,
                   **CASES[case])


def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    return torch.randn(5, IN, generator=g), torch.randint(0, OUT, (5,), generator=g)


def train(ps: Any, steps: range) -> None:
    for k in steps:
        x, y = batch(k)
        F.cross_entropy(ps(x), y).backward()
        ps.step()


def checkpoint(ps: Any) -> dict:
    """What the trainer-side checkpoint of ``ps`` holds (copies)."""
    return {"model": {k: v.detach().clone() for k, v in ps.state_dict().items()}, "optim": ps.optimizer_state_dict()}


def saved_and_loaded(name: str, case: str, directory: str, servers: list[str]) -> dict:
    """A model of ``case`` on ps0, ps1 trained 4 steps and saved with save_shards; loaded onto
    ``servers`` by load_shards and, as the reference, by load_state_dict +
    load_optimizer_state_dict (both trained 2 steps of their own first): each one's checkpoint
    right after, and after all three trained the same 4 steps more; the manifest and files."""
    from remote_module.ps import load_shards, save_shards

    source = model(name, ["ps0", "ps1"], case)
    train(source, range(4))
    manifest = save_shards(directory, {"model": source})
    saved = checkpoint(source)
    by_shards = model(name + "-shards", servers, case, seed=1)
    train(by_shards, range(100, 102))
    load_shards(directory, {"model": by_shards})
    by_state_dict = model(name + "-state-dict", servers, case, seed=1)
    train(by_state_dict, range(100, 102))
    by_state_dict.load_state_dict(saved["model"])
    by_state_dict.load_optimizer_state_dict(saved["optim"])
    out = {"saved": saved, "shards": checkpoint(by_shards), "state_dict": checkpoint(by_state_dict),
           "manifest": manifest, "files": sorted(os.listdir(directory))}
    for ps in (source, by_shards, by_state_dict):
        ps.flush()
        train(ps, range(4, 8))
    out["after"] = {"source": checkpoint(source), "shards": checkpoint(by_shards),
                    "state_dict": checkpoint(by_state_dict)}
    return out


def saved(name: str, directory: str, case: str = "adam-async", layout: str = "shared") -> dict:
    """A model of ``case`` on ps0, ps1 trained 3 steps and saved: the manifest."""
    from remote_module.ps import save_shards

    ps = model(name, ["ps0", "ps1"], case)
    train(ps, range(3))
    return save_shards(directory, {"model": ps}, layout=layout)


def refused_load(name: str, directory: str, servers: list[str], case: str = "adam-async",
                 module: nn.Module | None = None) -> dict:
    """Load the checkpoint in ``directory`` into a model of ``case`` on ``servers`` trained two
    steps first: the error (None if it loaded) and the model's checkpoint before and after."""
    from remote_module.ps import load_shards

    ps = model(name, servers, case, seed=1, module=module)
    if module is None:
        train(ps, range(200, 202))
    before = checkpoint(ps)
    try:
        load_shards(directory, {"model": ps})
        error = None
    except (ValueError, TypeError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "before": before, "after": checkpoint(ps)}


def wider(name: str, directory: str, servers: list[str]) -> dict:
    """:func:`refused_load` into a model whose hidden layer is wider than the saved one's."""
    torch.manual_seed(1)
    module = nn.Sequential(nn.Linear(IN, HIDDEN + 1), nn.BatchNorm1d(HIDDEN + 1), nn.ReLU(), nn.Linear(HIDDEN + 1, OUT))
    return refused_load(name, directory, servers, module=module)


def local_layout(name: str, directory: str) -> dict:
    """A model saved in the local layout and loaded onto the same servers: both checkpoints,
    the manifest and each folder's files."""
    from remote_module.ps import load_shards, save_shards

    ps = model(name, ["ps0", "ps1"], "adam-async")
    train(ps, range(3))
    manifest = save_shards(directory, {"model": ps}, layout="local")
    again = model(name + "-again", ["ps0", "ps1"], "adam-async", seed=1)
    load_shards(directory, {"model": again})
    return {"saved": checkpoint(ps), "loaded": checkpoint(again), "manifest": manifest,
            "files": {d: sorted(os.listdir(os.path.join(directory, d))) if os.path.isdir(os.path.join(directory, d))
                      else None for d in sorted(os.listdir(directory))}}


def trainer_bytes(name: str, directory: str, width: int) -> dict:
    """A ``width`` x ``width`` Linear on ps0, ps1 (Adam, async) trained a step, saved and loaded
    onto ps0-ps2 by shards, then through state_dict() / optimizer_state_dict(): what this
    trainer received and sent for each (tests/benchmarks/_caller_bytes.py)."""
    from remote_module.ps import PSModel, load_shards, save_shards
    from tests.benchmarks._caller_bytes import CallerBytes

    def make(suffix: str, servers: list[str]) -> Any:
        torch.manual_seed(0)
        return PSModel(nn.Linear(width, width), servers, name=name + suffix, num_trainers=1, ps_mode="async",
                       optimizer=(torch.optim.Adam, {"lr": 0.01}))

    ps = make("", ["ps0", "ps1"])
    ps(torch.randn(2, width)).sum().backward()
    ps.step()
    loaded = make("-loaded", ["ps0", "ps1", "ps2"])
    out = {}
    for what, run in (("save", lambda: save_shards(directory, {"model": ps})),
                      ("load", lambda: load_shards(directory, {"model": loaded})),
                      ("state_dict", lambda: (ps.state_dict(), ps.optimizer_state_dict()))):
        with CallerBytes() as counted:
            run()
        out[what] = {side: counted.other[side] + counted.tensor_bytes(side) for side in ("received", "sent")}
    return out


def job_checkpointed(name: str, directory: str, case: str) -> dict:
    """A model of ``case`` on ps0, ps1 trained 4 steps under a ``Checkpointer`` saving every 2
    (this trainer the job's only one): the model's checkpoint at each save, by step."""
    from remote_module.ps import Checkpointer

    ps = model(name, ["ps0", "ps1"], case)
    ckpt = Checkpointer(directory, every_steps=2, keep=3, ps={"model": ps}, trainers=["trainer0"])
    held = {}
    for k in range(ckpt.resume(), 4):
        train(ps, range(k, k + 1))
        if ckpt.step() is not None:
            held[ckpt.step_index] = checkpoint(ps)
    ckpt.close()
    return held


def job_resumed(name: str, directory: str, case: str) -> dict:
    """A fresh model (other initial values) resumed by a ``Checkpointer`` from ``directory``:
    the step it resumed from and the model's checkpoint."""
    from remote_module.ps import Checkpointer

    ps = model(name, ["ps0", "ps1", "ps2"], case, seed=1)
    ckpt = Checkpointer(directory, every_steps=2, keep=3, ps={"model": ps}, trainers=["trainer0"])
    start = ckpt.resume()
    return {"start": start, "model": checkpoint(ps)}


def old_ps_file_loaded(name: str, directory: str, case: str) -> dict:
    """A job checkpoint's ``ps.pt`` as the trainer wrote PSModels before they went to ``ps/``,
    read back by the job's load: the saved checkpoint and the loaded model's."""
    from pathlib import Path

    from remote_module.ps.checkpoint._job_state import _load_ps

    ps = model(name, ["ps0", "ps1"], case)
    train(ps, range(3))
    saved = checkpoint(ps)
    os.makedirs(directory, exist_ok=True)
    torch.save({"model": {"state": saved["model"], "optim": saved["optim"]}}, os.path.join(directory, "ps.pt"))
    fresh = model(name + "-fresh", ["ps0", "ps1", "ps2"], case, seed=1)
    _load_ps(Path(directory), {"model": fresh})
    return {"saved": saved, "loaded": checkpoint(fresh)}


class WithTable(nn.Module):
    """A sharded table and a dense head: the table's rows saved as a table's, the head as the
    PSModel's blocks."""

    def __init__(self, name: str, servers: list[str], seed: int) -> None:
        from remote_module.ps import ShardedEmbeddingBag

        super().__init__()
        torch.manual_seed(seed)
        self.emb = ShardedEmbeddingBag(20, 4, servers, name=name + "-emb", mode="sum", ps_mode="async",
                                       num_trainers=1, optimizer=(torch.optim.Adagrad, {"lr": 0.1}))
        self.head = nn.Linear(4, OUT)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids, offsets))


def with_table(name: str, directory: str) -> dict:
    """A PSModel holding a table on ps0, ps1 trained, saved, loaded onto ps0-ps2 by shards and
    by state_dict: both checkpoints and the manifest."""
    from remote_module.ps import PSModel, load_shards, save_shards

    def make(suffix: str, servers: list[str], seed: int) -> Any:
        return PSModel(WithTable(name + suffix, servers, seed), servers, name=name + suffix, num_trainers=1,
                       ps_mode="async", optimizer=(torch.optim.Adam, {"lr": 0.01}))

    def steps(ps: Any, ks: range) -> None:
        for k in ks:
            g = torch.Generator().manual_seed(k)
            ids, y = torch.randint(0, 20, (6,), generator=g), torch.randint(0, OUT, (2,), generator=g)
            F.cross_entropy(ps(ids, torch.tensor([0, 3])), y).backward()
            ps.step()

    source = make("", ["ps0", "ps1"], 0)
    steps(source, range(3))
    manifest = save_shards(directory, {"model": source})
    saved = checkpoint(source)
    by_shards, by_state_dict = make("-shards", ["ps0", "ps1", "ps2"], 1), make("-sd", ["ps0", "ps1", "ps2"], 1)
    load_shards(directory, {"model": by_shards})
    by_state_dict.load_state_dict(saved["model"])
    by_state_dict.load_optimizer_state_dict(saved["optim"])
    out = {"saved": saved, "shards": checkpoint(by_shards), "state_dict": checkpoint(by_state_dict),
           "manifest": manifest}
    for ps in (by_shards, by_state_dict):
        steps(ps, range(3, 6))
    out["after"] = {"shards": checkpoint(by_shards), "state_dict": checkpoint(by_state_dict)}
    return out
