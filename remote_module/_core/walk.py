"""Walking nested structures (lists, tuples, named tuples, dicts) to map their leaves.

Used where a value's *structure* matters (moving tensors to a device, flattening outputs); the
wire format does not rebuild containers (see ``remote_module._proxy.wire``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch


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
