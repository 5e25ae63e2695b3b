"""The pipeline benchmark's model and the host-side parts of its two reference points.

* the model: ``2 * layers_per_stage`` x (``Linear(width, width)`` + ``ReLU``), built from a
  fixed seed, so every process that builds it (the caller for ``split_sequential``, the
  hosts for the references) holds the same weights;
* the hand-written pattern of PyTorch's RPC pipeline tutorial: a shard object per stage
  host, one lock per stage, the input fetched from an RRef (``to_here``);
* ``torch.distributed.pipelining``: a ``PipelineStage`` + ``ScheduleGPipe`` per chunk count
  on each stage host, over a gloo group of the two stage hosts, driven by RPC from the
  caller (both hosts step together; the input batch lives on stage 0, the target on stage 1,
  as in an SPMD program).

Functions called over RPC are module level (RPC pickles them by reference).
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch import nn

STAGES = 2

# ---- the model ---------------------------------------------------------------------------


def build_model(cfg: dict) -> nn.Sequential:
    """The whole model, ``STAGES * layers_per_stage`` x (Linear + ReLU), seeded."""
    gen = torch.Generator().manual_seed(cfg["seed"])
    width = cfg["width"]
    layers: list[nn.Module] = []
    for _ in range(STAGES * cfg["layers_per_stage"]):
        linear = nn.Linear(width, width)
        with torch.no_grad():  # seeded and scaled so activations neither vanish nor explode
            linear.weight.normal_(0.0, (2.0 / width) ** 0.5, generator=gen)
            linear.bias.uniform_(-0.01, 0.01, generator=gen)
        layers += [linear, nn.ReLU()]
    return nn.Sequential(*layers)


def stage_bounds(cfg: dict, index: int) -> tuple[int, int]:
    """Child indices ``[a, b)`` of stage ``index`` in :func:`build_model`'s Sequential."""
    per_stage = 2 * cfg["layers_per_stage"]
    return index * per_stage, (index + 1) * per_stage


def stage_module(cfg: dict, index: int) -> nn.Sequential:
    a, b = stage_bounds(cfg, index)
    return build_model(cfg)[a:b]


def batch(cfg: dict) -> torch.Tensor:
    return torch.randn(cfg["batch"], cfg["width"], generator=torch.Generator().manual_seed(cfg["seed"] + 1))


def handler_threads() -> int:
    """``torch.get_num_threads()`` as an RPC handler thread of this process sees it."""
    return torch.get_num_threads()


# ---- reference 1: the RPC pipeline tutorial's pattern, by hand -----------------------------


class TutorialShard:
    """One stage as the tutorial holds it: the module and one lock serialising its forwards."""

    def __init__(self, cfg: dict, index: int) -> None:
        self.module = stage_module(cfg, index)
        self.lock = threading.Lock()
        self.held = batch(cfg)  # an input already on this host, for compute_alone

    def forward(self, x_rref: rpc.RRef) -> torch.Tensor:
        x = x_rref.to_here()  # stage 0 fetches the micro-batch from the caller, stage 1 from stage 0
        with self.lock, torch.no_grad():
            return self.module(x)


def tutorial_forward(shard: rpc.RRef, x_rref: rpc.RRef) -> torch.Tensor:
    return shard.local_value().forward(x_rref)


def compute_alone(shard: rpc.RRef) -> None:
    """The stage's forward on a batch already on its host: compute only, nothing travels."""
    me = shard.local_value()
    with me.lock, torch.no_grad():
        me.module(me.held)


def tutorial_pipeline(shards: list[rpc.RRef], x: torch.Tensor, chunks: int) -> torch.Tensor:
    """The caller's side: stage 0 by ``remote()``, stage 1 by ``rpc_async()`` on its RRef."""
    futures = []
    for micro in torch.tensor_split(x, chunks):
        y_rref = rpc.remote(shards[0].owner(), tutorial_forward, (shards[0], rpc.RRef(micro)))
        futures.append(rpc.rpc_async(shards[1].owner(), tutorial_forward, (shards[1], y_rref)))
    return torch.cat(torch.futures.wait_all(futures))


# ---- reference 2: torch.distributed.pipelining (GPipe), driven over RPC --------------------

_gpipe: dict = {}  # on a stage host: the stage's module, its schedules by chunk count, its data


def _sum_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return output.sum()


def gpipe_setup(cfg: dict, index: int) -> None:
    """On stage host ``index`` (its gloo group already up): one schedule per chunk count.

    Static ``input_args``/``output_args`` (micro-batch shaped): no shape inference at run time.
    """
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    module = stage_module(cfg, index)
    schedules = {}
    for chunks in cfg["chunks"]:
        if cfg["batch"] % chunks:
            raise ValueError(f"batch {cfg['batch']} must split evenly into {chunks} micro-batches")
        shape = (cfg["batch"] // chunks, cfg["width"])
        # requires_grad on the examples says which gradients travel: stage 0's input is data,
        # every other activation is differentiable
        inputs = torch.empty(shape, requires_grad=index > 0)
        outputs = torch.empty(shape, requires_grad=True)
        stage = PipelineStage(
            module, index, STAGES, torch.device("cpu"), input_args=inputs, output_args=outputs
        )
        # scale_grads=False: gradients of sum(output), as the project's pipeline computes them
        schedules[chunks] = ScheduleGPipe(stage, chunks, loss_fn=_sum_loss, scale_grads=False)
    _gpipe.update(module=module, schedules=schedules, x=batch(cfg), target=torch.zeros(cfg["batch"]))


def gpipe_ready() -> bool:
    return "schedules" in _gpipe


def gpipe_step(chunks: int) -> float | None:
    """One forward+backward step; on the last stage returns the loss (sum over micro-batches)."""
    module, schedule = _gpipe["module"], _gpipe["schedules"][chunks]
    module.zero_grad(set_to_none=True)
    if dist.get_rank() == 0:
        schedule.step(_gpipe["x"])
        return None
    losses: list[torch.Tensor] = []
    schedule.step(target=_gpipe["target"], losses=losses)
    return float(sum(loss.item() for loss in losses))
