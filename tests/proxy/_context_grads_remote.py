"""Host side of tests/proxy/test_clip_grad_norm.py (module level: RPC pickles by reference)."""

from __future__ import annotations

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc


def context_grads(context_id: int, module_rref: rpc.RRef) -> list[torch.Tensor | None]:
    """Copies of the context's gradients of the module's parameters on this host (None: none)."""
    grads = dist_autograd.get_gradients(context_id)
    return [None if grads.get(p) is None else grads[p].clone() for p in module_rref.local_value().parameters()]
