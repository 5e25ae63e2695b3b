"""What ``run_local`` can send to its ranks and back, checked where a failure is clearest.

The function and its arguments are checked in the caller, before any process starts
(:func:`check_importable`, :func:`raise_if_unsendable`): each rank imports the function by
module and name, so a lambda, a nested function or one defined under ``if __name__ ==
"__main__":`` fails there with a ``TypeError`` naming it. A rank's return value is pickled by
value in the rank (:func:`result_bytes`); one that cannot be pickled names its offending part.
"""

from __future__ import annotations

import ast
import io
import pickle
import sys
from typing import Any

_IMPORTABLE = (
    "each rank imports the function by its module and name, so it must be defined at the top "
    "level of a module the ranks can import (the script run as __main__ counts, with its "
    "run_local call under `if __name__ == \"__main__\":`), not a lambda, a function nested in "
    "another or a method of a local class; pass what it needs through args=(...)"
)


def check_importable(fn: Any) -> None:
    """Raise ``TypeError`` unless the ranks can import ``fn`` (it pickles by reference, and not
    to ``__main__`` of a session that has no file for the ranks to run: ``python -c``, stdin, a
    notebook). Checked in the caller, before any process starts."""
    if not callable(fn):
        raise TypeError(f"run_local's fn must be callable, got {fn!r}")
    modules: set[str | None] = set()
    from_main: set[str] = set()  # the top-level names in __main__ that fn refers to

    class Recorder(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__"):
                module = getattr(obj, "__module__", None)
                modules.add(module)
                if module == "__main__":
                    from_main.add(str(obj.__qualname__).split(".")[0])
            return NotImplemented

    try:
        Recorder(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL).dump(fn)
    except Exception as exc:
        raise TypeError(
            f"run_local cannot send fn {_callable_name(fn)} to its ranks ({type(exc).__name__}: {exc}): "
            f"{_IMPORTABLE}"
        ) from None
    main = sys.modules.get("__main__")
    if "__main__" in modules and main is not None and not _main_importable(main):
        raise TypeError(
            f"run_local cannot send fn {_callable_name(fn)} to its ranks: it is (or refers to) code defined "
            f"in __main__ of a session that has no file the ranks could import (python -c, stdin, a "
            f"notebook); put it in a file, a module or the script you run, and import it from there"
        )
    guarded = sorted(from_main - _main_top_level_names(main)) if from_main and main is not None else []
    if guarded:
        raise TypeError(
            f"run_local cannot send fn {_callable_name(fn)} to its ranks: {', '.join(guarded)} is defined under "
            f"`if __name__ == \"__main__\":` in {main.__file__}, which the ranks do not run (each imports the "
            f"script as __mp_main__, as a spawned process does); define it at the script's top level"
        )


def _main_top_level_names(main: Any) -> set[str]:
    """The names the script run as ``__main__`` binds at its top level outside an
    ``if __name__ == "__main__":`` block (what a rank importing it has); every name of
    ``main`` when that cannot be told (no source file, a star import)."""
    everything = set(vars(main))
    path = getattr(main, "__file__", None)
    try:
        with open(path, encoding="utf-8") as f:  # type: ignore[arg-type]
            tree = ast.parse(f.read())
    except (OSError, TypeError, SyntaxError, ValueError):
        return everything

    def is_main_guard(test: ast.expr) -> bool:
        return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
                and len(test.comparators) == 1 and isinstance(test.comparators[0], ast.Constant)
                and test.comparators[0].value == "__main__")

    names: set[str] = set()
    body = list(tree.body)
    while body:
        node = body.pop()
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            return everything
        if isinstance(node, ast.If) and is_main_guard(node.test):
            body += node.orelse
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
            continue
        stores = [n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
        if isinstance(node, (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try)):
            # a block: its statements bind at the top level too (the walk above over-counts names
            # bound inside functions defined in it: that only lets more through)
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    body.append(child)
                elif isinstance(child, ast.excepthandler):
                    body += child.body
        names.update(stores)
    return names


def _main_importable(main: Any) -> bool:
    """Whether a rank can import ``main`` as ``__mp_main__``, as ``multiprocessing`` decides
    (``-m`` module name or the script's file)."""
    name = getattr(getattr(main, "__spec__", None), "name", None)
    return name is not None or getattr(main, "__file__", None) is not None


def _callable_name(fn: Any) -> str:
    name = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    if name is None:
        return repr(fn)
    return f"{module}.{name}" if module else name


def raise_if_unsendable(args: tuple, exc: Exception) -> None:
    """When ``args`` cannot be pickled (the reason ``exc`` was raised), a ``TypeError`` naming
    the offending argument; otherwise nothing."""
    try:
        pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        where, culprit = _first_unpicklable(args, "args")
        what = _callable_name(culprit) if callable(culprit) else f"of type {_type_name(culprit)}"
        raise TypeError(
            f"run_local cannot send {where} ({what}) to its ranks: it cannot be pickled "
            f"({type(exc).__name__}: {exc}); a function or class passed in args must be defined at "
            f"the top level of a module the ranks can import, and other values must be picklable"
        ) from None


class UnpicklableResult(Exception):
    """A rank's return value cannot be pickled; the message names the offending type."""


def result_bytes(value: Any) -> bytes:
    """``value`` pickled by value with the plain pickler.

    The result queue's own pickler (multiprocessing's, with torch's reducers) would share a
    tensor's storage through a file descriptor of this process, which is gone by the time the
    caller reads it; plain pickle copies tensors into the bytes instead.
    """
    try:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        where, culprit = _first_unpicklable(value, "result")
        raise UnpicklableResult(
            f"fn returned a value run_local cannot send back: {where} is of type "
            f"{_type_name(culprit)}, which cannot be pickled ({type(exc).__name__}: {exc}); return "
            f"picklable data instead (tensors, numbers, strings, lists, dicts, ...)"
        ) from None


def _first_unpicklable(value: Any, where: str, depth: int = 0) -> tuple[str, Any]:
    """The path and value of the innermost part of ``value`` that cannot be pickled, looking
    into lists, tuples, sets and dicts; ``value`` itself when no part is to blame."""
    if depth < 20:
        if isinstance(value, dict):
            items: Any = [(f"{where}[{k!r}]", v) for k, v in value.items()]
            items += [(f"a key of {where}", k) for k in value]
        elif isinstance(value, (list, tuple)):
            items = [(f"{where}[{i}]", v) for i, v in enumerate(value)]
        elif isinstance(value, (set, frozenset)):
            items = [(f"an element of {where}", v) for v in value]
        else:
            items = []
        for inner_where, inner in items:
            try:
                pickle.dumps(inner, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception:
                return _first_unpicklable(inner, inner_where, depth + 1)
    return where, value


def _type_name(value: Any) -> str:
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
