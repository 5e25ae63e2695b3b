"""Shipping ``module_cls`` by value when the host cannot import it by reference.

A class (or factory) defined in ``__main__``, in a notebook, or inside a function is pickled
by reference as ``module.qualname``, which the host cannot resolve. Those travel by value with
cloudpickle, together with their constructor arguments; importable classes still travel by
reference (smaller messages, and the host runs the installed code).
"""

from __future__ import annotations

import importlib.util
import pickle
import types
from typing import Any

import cloudpickle

_MAIN_MODULES = ("__main__", "__mp_main__")


def importable_by_reference(obj: Any) -> bool:
    """True when ``pickle`` can send ``obj`` by name and another process can import that name."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", "")
    if module is None or module in _MAIN_MODULES or "<locals>" in qualname or "<lambda>" in qualname:
        return False
    try:
        if importlib.util.find_spec(module) is None:
            return False
    except (ImportError, ValueError):
        return False
    try:
        pickle.dumps(obj)
    except Exception:
        return False
    return True


def _needs_value(module_cls: Any, args: tuple, kwargs: dict) -> bool:
    # Instances of __main__ / local classes among the arguments cannot go by reference either.
    return not all(importable_by_reference(x) for x in (module_cls, *map(type, (*args, *kwargs.values()))))


class ByValue:
    """A constructor call (``module_cls``, args, kwargs) serialized with cloudpickle."""

    __slots__ = ("payload", "name")

    def __init__(self, payload: bytes, name: str) -> None:
        self.payload = payload
        self.name = name

    def load(self) -> tuple[Any, tuple, dict]:
        return pickle.loads(self.payload)  # cloudpickle output loads with plain pickle

    def __reduce__(self) -> tuple:
        return ByValue, (self.payload, self.name)


def pack_constructor(module_cls: Any, args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
    """What to send for ``module_cls(*args, **kwargs)``: as is, or one :class:`ByValue`."""
    if not _needs_value(module_cls, args, kwargs):
        return module_cls, args, kwargs
    name = getattr(module_cls, "__qualname__", repr(module_cls))
    return ByValue(cloudpickle.dumps((module_cls, args, kwargs)), name), (), {}


def unpack_constructor(module_cls: Any, args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
    """Host side of :func:`pack_constructor`."""
    if isinstance(module_cls, ByValue):
        return module_cls.load()
    return module_cls, args, kwargs


def _load_by_value(payload: bytes) -> Any:
    return pickle.loads(payload)


def by_value_reduce(obj: Any) -> tuple | None:
    """For a pickler's ``reducer_override``: a reduce tuple that ships ``obj`` by value when it is
    a class or function another process cannot import by name; None for anything else.

    Example::

        class _Pickler(pickle.Pickler):
            def reducer_override(self, obj):
                reduced = by_value_reduce(obj)
                return NotImplemented if reduced is None else reduced
    """
    if not isinstance(obj, (type, types.FunctionType)) or importable_by_reference(obj):
        return None
    return _load_by_value, (cloudpickle.dumps(obj),)
