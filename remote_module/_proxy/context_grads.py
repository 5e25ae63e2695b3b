"""Gradients of a model holding proxies, inside a distributed autograd context.

Inside ``with dist_autograd.context() as ctx:``, ``dist_autograd.backward(ctx, [loss])`` keeps
every gradient in the context, on the worker that owns the parameter (read with
``dist_autograd.get_gradients(ctx)`` there), and never in ``.grad``; ``DistributedOptimizer``
steps from the context. So torch's ``nn.utils.clip_grad_norm_(model.parameters(), c)`` finds no
gradient, returns 0 and clips nothing, without a word. :func:`clip_grad_norm_` clips the
context's gradients as torch's clips ``.grad``: the same total norm (over the local parameters'
gradients and the remote modules' on their hosts), the same scale, in place, so that
``opt.step(ctx)`` applies the clipped gradients. ``get_gradients`` answers with the context's
own tensors (not copies), which is what lets a host scale them where they are.

The other half, telling: a proxy's ``remote_requires_grad`` handle is in ``model.parameters()``,
so whatever reads ``.grad`` over them (torch's clip, a local optimizer, a gradient logger) reads
the handle's; inside a context that read warns once per process
(:func:`warn_grad_read_in_context`, called by the handle in ``remote_module._proxy.idioms``).
"""

from __future__ import annotations

import types
import warnings
from typing import Any, Iterable

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn

from remote_module._core import call_all, in_dist_autograd_context, user_stacklevel

#: Set once the warning of :func:`warn_grad_read_in_context` was shown in this process.
_warned = False

_NO_CONTEXT = "Could not find autograd context with id"


def warn_grad_read_in_context() -> None:
    """Warn (once per process) that ``.grad`` of a model holding a RemoteModule was read inside a
    distributed autograd context, where no gradient is in ``.grad``. Silent outside one."""
    global _warned
    if _warned or not in_dist_autograd_context():
        return
    _warned = True
    warnings.warn(
        "read .grad of a model holding a RemoteModule inside a torch.distributed.autograd context: there "
        "dist_autograd.backward keeps every gradient in the context (dist_autograd.get_gradients(ctx) on the "
        "worker owning each parameter), not in .grad, so what reads .grad (torch.nn.utils.clip_grad_norm_, a "
        "local optimizer's step) sees none of them, of the local parameters or the remote ones, and changes "
        "nothing. Clip with remote_module.clip_grad_norm_(ctx, model.parameters(), max_norm) and step with "
        "DistributedOptimizer(...).step(ctx). (Shown once per process.)",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


def _context_grads(context_id: int) -> dict | None:
    """This worker's gradients in the context (the context's own tensors), or None where the
    context never reached this worker (a host whose modules the forward did not call)."""
    try:
        return dist_autograd.get_gradients(context_id)
    except RuntimeError as exc:
        if _NO_CONTEXT in str(exc):
            return None
        raise


def _resolve(items: list, grads: dict) -> list[list[torch.Tensor]]:
    """For each item (a parameter, a module, or an RRef of either owned here), the gradients in
    ``grads`` of the parameters it stands for that an earlier item did not (one module reached
    through two proxies counts once, as in ``model.parameters()``)."""
    seen: set[int] = set()
    out = []
    for item in items:
        value = item.local_value() if isinstance(item, rpc.PyRRef) else item
        params = list(value.parameters()) if isinstance(value, nn.Module) else [value]
        found = []
        for p in params:
            if id(p) in seen:
                continue
            seen.add(id(p))
            g = grads.get(p)
            if g is not None:
                found.append(g)
        out.append(found)
    return out


def _grad_norms(context_id: int, items: list, norm_type: float) -> list[list[torch.Tensor]]:
    """Host side: the norm of each context gradient of ``items``' parameters, per item (CPU)."""
    grads = _context_grads(context_id)
    if grads is None:
        return [[] for _ in items]
    with torch.no_grad():
        return [[torch.linalg.vector_norm(g, norm_type).cpu() for g in found] for found in _resolve(items, grads)]


def _scale_grads(context_id: int, items: list, coef: torch.Tensor) -> int:
    """Host side: multiply the context gradients of ``items``' parameters by ``coef`` in place
    (the context keeps them, so ``DistributedOptimizer.step(ctx)`` applies them scaled)."""
    grads = _context_grads(context_id)
    if grads is None:
        return 0
    n = 0
    with torch.no_grad():
        for found in _resolve(items, grads):
            for g in found:
                g.mul_(coef.to(g.device))
                n += 1
    return n


def _targets(parameters: Any) -> list[tuple[str | None, Any]]:
    """``(owner, item)`` for what ``parameters`` names: a local tensor (owner None), or a remote
    module or parameter on worker ``owner``. A proxy's handle stands for its remote module."""
    from remote_module._proxy.idioms import RequiresGradHandle  # idioms imports this module

    if isinstance(parameters, nn.Module):
        items: Iterable = parameters.parameters()
    elif isinstance(parameters, (torch.Tensor, rpc.PyRRef)):
        items = [parameters]
    else:
        is_generator = isinstance(parameters, types.GeneratorType)
        items = list(parameters)
        if is_generator and not items:
            warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.", stacklevel=3)
    me = rpc.get_worker_info().name
    out: list[tuple[str | None, Any]] = []
    for item in items:
        if isinstance(item, RequiresGradHandle):
            proxy = item.proxy()
            if proxy is not None:  # a handle is installed once its proxy is connected
                owner = proxy.module_rref.owner_name()
                out.append((None if owner == me else owner, proxy.module_rref))
        elif isinstance(item, rpc.PyRRef):
            owner = item.owner_name()
            out.append((None, item.local_value()) if owner == me else (owner, item))
        elif isinstance(item, torch.Tensor):
            out.append((None, item))
        else:
            raise TypeError(
                "remote_module.clip_grad_norm_ takes a module, or parameters: tensors, RRefs of remote "
                f"parameters (proxy.remote_parameters()) and proxies' handles (model.parameters()); got "
                f"{type(item).__name__}"
            )
    return out


def clip_grad_norm_(
    context_id: int,
    parameters: Any,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for gradients in a distributed autograd context.

    Inside ``with dist_autograd.context() as ctx:`` after ``dist_autograd.backward(ctx, [loss])``
    the gradients are in the context, not in ``.grad``, where torch's ``clip_grad_norm_`` looks
    (it finds none and clips nothing). This computes the total norm of the context's gradients
    of ``parameters`` as torch does (the ``norm_type`` norm of each gradient's norm), over the
    local ones and the remote ones on their hosts (one message per host), and when it exceeds
    ``max_norm`` multiplies every one of them in place by ``max_norm / (total + 1e-6)`` (one
    more message per host), so that ``DistributedOptimizer.step(ctx)`` applies them clipped.
    Returns the total norm. A parameter without a gradient in the context (frozen, unused)
    counts for nothing, as one without ``.grad`` does for torch.

    ``parameters``: ``model.parameters()`` (each RemoteModule proxy's ``remote_requires_grad``
    handle there stands for all its remote module's parameters; pipelines and sharded modules
    hold proxies too), the model itself, or the list given to ``DistributedOptimizer`` (local
    tensors and RRefs of remote parameters). ``error_if_nonfinite=True`` raises torch's
    ``RuntimeError`` before anything is scaled. ``foreach`` is accepted for torch's signature:
    it only chooses torch's kernels there; each gradient's norm is computed alone here.

    Example::

        with dist_autograd.context() as ctx:
            loss = criterion(model(x), y)
            dist_autograd.backward(ctx, [loss])
            remote_module.clip_grad_norm_(ctx, model.parameters(), 0.25)
            opt.step(ctx)
    """
    del foreach
    norm_type = float(norm_type)
    max_norm = float(max_norm)
    try:
        local_grads = dist_autograd.get_gradients(context_id)
    except RuntimeError as exc:
        raise RuntimeError(
            f"remote_module.clip_grad_norm_: no distributed autograd context {context_id!r} here ({exc}); pass "
            "the id of the live context the backward ran in: inside `with dist_autograd.context() as ctx:`, "
            "after dist_autograd.backward(ctx, [loss]) and before leaving it"
        ) from None
    targets = _targets(parameters)
    hosts: dict[str, list[int]] = {}
    for i, (owner, _) in enumerate(targets):
        if owner is not None:
            hosts.setdefault(owner, []).append(i)
    local = [i for i, (owner, _) in enumerate(targets) if owner is None]
    per_item: list[list[torch.Tensor]] = [[] for _ in targets]
    with torch.no_grad():
        for i, found in zip(local, _resolve([targets[i][1] for i in local], local_grads)):
            per_item[i] = [torch.linalg.vector_norm(g, norm_type) for g in found]
        answers = call_all([(owner, _grad_norms, (context_id, [targets[i][1] for i in idx], norm_type))
                            for owner, idx in hosts.items()])
        for idx, norms in zip(hosts.values(), answers):
            for i, n in zip(idx, norms):
                per_item[i] = n
        norms = [n for item in per_item for n in item]
        if not norms:
            return torch.tensor(0.0)
        device = norms[0].device  # the first gradient's (a host's come as CPU tensors), as torch's
        total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)
        if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from "
                "`parameters` is non-finite, so it cannot be clipped. To disable "
                "this error and scale the gradients by the non-finite norm anyway, "
                "set `error_if_nonfinite=False`"
            )
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if coef.item() == 1.0:
            return total  # torch multiplies by 1.0 here, which changes no value
        if local:
            _scale_grads(context_id, [targets[i][1] for i in local], coef)
        call_all([(owner, _scale_grads, (context_id, [targets[i][1] for i in idx], coef.cpu()))
                  for owner, idx in hosts.items()])
    return total
