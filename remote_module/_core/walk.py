"""Walking nested structures (lists, tuples, named tuples, dicts) to map their leaves.

Used where a value's *structure* matters (moving tensors to a device, flattening outputs); the
wire format does not rebuild containers (see ``remote_module._proxy.wire``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn


def map_leaves(fn: Callable[[Any], Any], obj: Any, leaf_type: type) -> Any:
    """Apply ``fn`` to every ``leaf_type`` instance in ``obj``, keeping its structure.

    Lists, tuples (named tuples too) and dicts are walked recursively; anything else is
    returned as it is. A leaf is mapped as a whole (a tensor is never iterated into rows).
    """
    if isinstance(obj, leaf_type):
        return fn(obj)
    if isinstance(obj, dict):
        mapped = {k: map_leaves(fn, v, leaf_type) for k, v in obj.items()}
        if type(obj) is dict:
            return mapped
        try:  # OrderedDict and friends keep their type
            return type(obj)(mapped)
        except TypeError:
            return mapped
    if isinstance(obj, tuple):
        items = [map_leaves(fn, v, leaf_type) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, list):
        return [map_leaves(fn, v, leaf_type) for v in obj]
    return obj


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """Apply ``fn`` to every tensor in ``obj``, keeping its structure (see :func:`map_leaves`).

    Example::

        >>> map_tensors(lambda t: t * 2, {"a": [torch.ones(1)], "b": 3})
        {'a': [tensor([2.])], 'b': 3}
    """
    return map_leaves(fn, obj, torch.Tensor)


def parameters_as_views(obj: Any) -> Any:
    """``obj`` with every ``nn.Parameter`` in it (in tuples, lists, dicts) replaced by a view of
    itself, the same view for the same parameter; ``obj`` itself when it holds none.

    torch RPC pickles an ``nn.Parameter`` by its data, detached (pytorch/pytorch#86525), so a
    parameter sent as an argument inside a distributed autograd context would never get a
    gradient; a view is an ordinary tensor of the graph, and its gradient reaches the
    parameter, as it does when the parameter is passed to a local module.

    Example::

        w = nn.Parameter(torch.ones(2))
        (sent,) = parameters_as_views((w,))     # sent._base is w
    """
    if not _holds_parameter(obj):
        return obj
    views: dict[int, torch.Tensor] = {}

    def view(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter) or isinstance(t, nn.parameter.UninitializedParameter):
            return t
        found = views.get(id(t))
        if found is None:
            found = views[id(t)] = t.view_as(t)
        return found

    return map_tensors(view, obj)


def _holds_parameter(obj: Any) -> bool:
    stack, seen = [obj], set()
    while stack:
        v = stack.pop()
        if isinstance(v, nn.Parameter):
            return True
        if isinstance(v, (tuple, list, dict)) and id(v) not in seen:
            seen.add(id(v))
            stack.extend(v.values() if isinstance(v, dict) else v)
    return False
