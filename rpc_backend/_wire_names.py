"""What a package's build sends by reference over RPC, read from its source without importing
it: the names and shapes that :mod:`rpc_backend.builds` fingerprints.

A Python call over RPC pickles its function, and the classes of its arguments and answer, by
``module.qualified_name``, and calls the function with the arguments the caller wrote; a
NamedTuple travels as its values in field order. So two builds speak one wire only when they
agree on:

* every module-level function: its name and its parameters (name and kind: positional-only,
  positional-or-keyword, ``*args``, keyword-only, ``**kwargs``), in order;
* every class, at module level or nested in a class: its name, its methods' names and
  parameters, and the fields its body annotates (``x: int``: a NamedTuple's or a dataclass's),
  in order.

What does not change a call on the wire leaves the fingerprint as it is: comments, docstrings,
function bodies, default values, annotations' types, decorators, the order of definitions.
A private helper that never travels counts all the same (reading the source cannot tell what
travels): a build that only adds one is refused, which is safe, and is fixed as every
mismatch is, by installing one build everywhere. Definitions under a module-level ``if``,
``try`` or ``with`` count as the module's own.
"""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path
from typing import Iterable, Iterator


def fingerprint(version: str | None, names: Iterable[str]) -> str:
    """A SHA-256 (its first 16 hex digits) of ``version`` and ``names``, sorted: equal in every
    process for equal inputs (no hash seed, no ``id``).

    Example::

        fingerprint("0.1.0", ["pkg.host:handler(x)"]) != fingerprint("0.1.0", ["pkg.host:handler(x,y)"])
    """
    digest = hashlib.sha256((version or "").encode())
    for name in sorted(set(names)):
        digest.update(b"\0" + name.encode())
    return digest.hexdigest()[:16]


def signature(args: ast.arguments) -> str:
    """The parameters of a ``def`` as the wire sees them: names and kinds, in order
    (``a,/,b,*c,d,**e``); no defaults, no annotations."""
    parts = [a.arg for a in args.posonlyargs]
    if args.posonlyargs:
        parts.append("/")
    parts += [a.arg for a in args.args]
    if args.vararg is not None:
        parts.append(f"*{args.vararg.arg}")
    elif args.kwonlyargs:
        parts.append("*")
    parts += [a.arg for a in args.kwonlyargs]
    if args.kwarg is not None:
        parts.append(f"**{args.kwarg.arg}")
    return ",".join(parts)


def _definitions(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements of ``body`` that define names at its level, looking into ``if``, ``try``
    and ``with`` blocks (not into functions)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.AnnAssign)):
            yield node
        elif isinstance(node, ast.If):
            yield from _definitions(node.body + node.orelse)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            yield from _definitions(node.body)
        elif isinstance(node, ast.Try):
            handlers = [stmt for handler in node.handlers for stmt in handler.body]
            yield from _definitions(node.body + handlers + node.orelse + node.finalbody)


def _shapes(prefix: str, body: list[ast.stmt]) -> Iterator[str]:
    """``prefix`` + each function's ``name(signature)`` and each class's ``Name{fields}`` in
    ``body``, and its methods and nested classes as ``Name.method(...)``."""
    for node in _definitions(body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{prefix}{node.name}({signature(node.args)})"
        elif isinstance(node, ast.ClassDef):
            fields = [n.target.id for n in _definitions(node.body)
                      if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
            yield f"{prefix}{node.name}{{{','.join(fields)}}}"
            yield from _shapes(f"{prefix}{node.name}.", node.body)


def module_shapes(module: str, text: str) -> list[str]:
    """``module:shape`` of every function and class ``text`` (the source of ``module``)
    defines (see the module docstring); ``[module:?]`` when it does not parse.

    Example::

        module_shapes("pkg.host", "class Plan(NamedTuple):\\n    rows: list\\n    def size(self): ...\\n")
        # ["pkg.host:Plan{rows}", "pkg.host:Plan.size(self)"]
    """
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return [f"{module}:?"]
    return [f"{module}:{shape}" for shape in _shapes("", tree.body)]


def defined_names(package: str, root: Path) -> list[str]:
    """:func:`module_shapes` of every ``.py`` file under ``root`` (the package ``package``):
    what pickle can send by reference, and how it is called. Read from the files, not imported.
    A file that cannot be read counts by its name, as ``module:?``.

    Example::

        defined_names("rpc_backend", Path(rpc_backend.__file__).parent)
        # [..., "rpc_backend.builds:answer_builds(packages)", ...]
    """
    found: list[str] = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        module = ".".join((package, *parts[:-1]) if parts[-1] == "__init__" else (package, *parts))
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            found.append(f"{module}:?")
            continue
        found += module_shapes(module, text)
    return found
