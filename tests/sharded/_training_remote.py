"""What the sharded-training tests run on the workers (importable there): the shards of a
Megatron-style MLP, a tensor that says where it was unpickled, and questions to the hosts."""

from __future__ import annotations

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn


class ColumnShard(nn.Module):
    """Column-parallel shard: ``relu(x @ W_r.T + b_r)``, this rank's output columns.

    Built from its slices (``weight``: rows of the full weight, ``bias``: the same entries of
    the full bias), or with zeros when only the sizes are given (for load_state_dict)."""

    def __init__(self, d_in: int, d_out: int, weight: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.linear = nn.Linear(d_in, d_out)
        with torch.no_grad():
            self.linear.weight.copy_(weight if weight is not None else torch.zeros(d_out, d_in))
            self.linear.bias.copy_(bias if bias is not None else torch.zeros(d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class RowShard(nn.Module):
    """Row-parallel shard without bias: ``x_r @ W_r.T`` (``W_r``: this rank's input columns);
    the workers' results sum to the full product."""

    def __init__(self, d_in: int, d_out: int, weight: torch.Tensor | None = None) -> None:
        super().__init__()
        self.linear = nn.Linear(d_in, d_out, bias=False)
        with torch.no_grad():
            self.linear.weight.copy_(weight if weight is not None else torch.zeros(d_out, d_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


# ---- proving where the intermediate activation went ------------------------------------------

#: Workers (names) on which a :class:`Tracer` was unpickled, in this process.
ARRIVALS: list[str] = []
#: What :class:`RecordingRowShard` received: (type name, data pointer); and what
#: :class:`TracingColumnShard` / :class:`PtrColumnShard` produced: data pointers.
RECEIVED: list[tuple[str, int]] = []
PRODUCED: list[int] = []


class Tracer(torch.Tensor):
    """A tensor subclass whose unpickling appends this worker's name to :data:`ARRIVALS`.
    It pickles as plain-tensor data plus :func:`rebuild_tracer`."""

    def __reduce_ex__(self, protocol):  # noqa: ANN001, ANN204
        return rebuild_tracer, (self.as_subclass(torch.Tensor),)


def rebuild_tracer(data: torch.Tensor) -> Tracer:
    ARRIVALS.append(rpc.get_worker_info().name)
    data.__class__ = Tracer
    return data


class TracingColumnShard(ColumnShard):
    """A column-parallel shard whose output is a :class:`Tracer` (forward-only use: a tensor
    subclass breaks distributed autograd's backward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x).as_subclass(Tracer)
        PRODUCED.append(out.data_ptr())
        return out


class PtrColumnShard(ColumnShard):
    """A column-parallel shard that records its output's data pointer (usable under autograd)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        PRODUCED.append(out.data_ptr())
        return out


class RecordingRowShard(RowShard):
    """A row-parallel shard that records the type and data pointer of its input, then computes
    on it as a plain tensor (so its own output is no Tracer)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        RECEIVED.append((type(x).__name__, x.data_ptr()))
        return super().forward(x.as_subclass(torch.Tensor))


def records() -> dict:
    """This process's records: arrivals, produced pointers, received (type, pointer)."""
    return {"arrivals": list(ARRIVALS), "produced": list(PRODUCED), "received": list(RECEIVED)}


def clear_records() -> None:
    ARRIVALS.clear()
    PRODUCED.clear()
    RECEIVED.clear()


def make_tracer() -> Tracer:
    """Run on a host: a Tracer to send back (the caller's positive control)."""
    return torch.ones(2, 2).as_subclass(Tracer)


# ---- questions to the hosts ------------------------------------------------------------------


def gradient_of(param: rpc.RRef, context_id: int) -> torch.Tensor | None:
    """On the owner of ``param``: its gradient in distributed autograd context ``context_id``."""
    return dist_autograd.get_gradients(context_id).get(param.local_value())


def value_of(param: rpc.RRef) -> torch.Tensor:
    """On the owner of ``param``: a copy of its value."""
    return param.local_value().detach().clone()


def held_count() -> int:
    """How many shards this process holds (for leak checks)."""
    from remote_module.sharded import _host

    return len(_host._store)


def rref_requires_grad(param_rref: rpc.RRef) -> bool:
    """Run on a parameter's owner: whether it requires grad."""
    return param_rref.local_value().requires_grad


class Scale(nn.Module):
    """``x * w``: a weight the caller holds, given with the call."""

    def forward(self, x, w):
        return x * w

