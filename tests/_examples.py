"""Docstring examples of the source, read with ``ast`` (used by test_docstrings.py).

:func:`example_blocks` finds every ``Example::`` block (``Example (...)::`` too) of every
docstring in a file; :func:`unresolved_names` returns, for one block written in Python, each
name that should resolve and does not. A dotted name is checked when its first part is

- ``remote_module`` or ``rpc_backend``, or ``ps`` read as ``remote_module.ps`` where what
  follows is written as a module's member is (a class, ``ps.PSModel``, or a private module,
  ``ps._packed``; ``ps.state_dict()`` is a ``PSModel`` the example calls ``ps``),
- a name the block imports (``from remote_module.ps import PSModel`` makes ``PSModel.x``
  checked; an import of a module that is not installed here, a user's ``mylib``, is not),
- a name the docstring's own module defines, or
- a public name of the packages (the ``__all__`` of ``remote_module``, its ``pipeline``,
  ``sharded`` and ``ps``, and ``rpc_backend``), which examples use without importing,

unless the block binds that name itself (``ps = ...``, ``class Tagged(...)``). Each part is
looked up with ``getattr`` (and, on a package, imported as a submodule); an attribute that
only instances have does not count as missing when the class annotates it or an
``__init__`` of the class assigns it. A class name (``CapWords``) that the block uses without
binding or importing it must be one of those names too (``RowState``, which no module
defines, is reported); other bare names are the example's own variables.
"""

from __future__ import annotations

import ast
import builtins
import doctest
import importlib
import inspect
import re
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator, NamedTuple

PACKAGES = ("remote_module", "rpc_backend")
PUBLIC = ("remote_module", "remote_module.pipeline", "remote_module.sharded", "remote_module.ps", "rpc_backend")
ALIAS, ALIASED = "ps", "remote_module.ps"  # how the guides and docstrings call the PS package
_CLASS_NAME = re.compile(r"^_?[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*$")

_HEADER = re.compile(r"^(\s*)Examples?\b[^\n]*::\s*$")
_MISSING = object()


class Block(NamedTuple):
    """One ``Example::`` block: where it starts (file line of its header), the text (dedented,
    doctest prompts and output removed) and the module whose docstring holds it."""

    path: Path
    line: int
    module: str
    text: str


def module_name(root: Path, path: Path) -> str:
    """The dotted name of the module at ``path`` (under ``root``)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files(root: Path) -> list[Path]:
    """Every ``.py`` file of the two packages under ``root``."""
    return sorted(p for package in PACKAGES for p in (root / package).rglob("*.py") if "__pycache__" not in p.parts)


def _docstrings(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """``(line of the docstring's first line, text)`` of the module's, every class's and every
    function's docstring (nested ones too)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            doc = first.value if isinstance(first, ast.Expr) else None
            if isinstance(doc, ast.Constant) and isinstance(doc.value, str):
                yield first.lineno, doc.value


def _as_python(lines: list[str]) -> str:
    """A block's text: doctest prompts removed and their output lines dropped."""
    text = textwrap.dedent("\n".join(lines))
    if not any(line.lstrip().startswith(">>>") for line in text.splitlines()):
        return text
    kept = []
    for line in text.splitlines():
        stripped = line.lstrip()
        if stripped.startswith(">>>") or stripped.startswith("..."):
            kept.append(stripped[4:])
    return "\n".join(kept)


def example_blocks(root: Path, path: Path) -> Iterator[Block]:
    """Every ``Example::`` block of every docstring in ``path``."""
    name = module_name(root, path)
    for start, doc in _docstrings(ast.parse(path.read_text())):
        lines = doc.expandtabs().splitlines()
        i = 0
        while i < len(lines):
            header = _HEADER.match(lines[i])
            i += 1
            if not header:
                continue
            at, indent, body = start + i - 1, len(header.group(1)), []
            while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
                body.append(lines[i])
                i += 1
            while body and not body[-1].strip():
                body.pop()
            if body:
                yield Block(path, at, name, _as_python(body))


def parse(block: Block) -> ast.Module | None:
    """The block's syntax tree, or None where it is not Python (a shell command, a diagram)."""
    try:
        return ast.parse(block.text)
    except SyntaxError:
        return None


def _dotted(node: ast.AST) -> list[str] | None:
    """``["a", "b", "c"]`` for the expression ``a.b.c``; None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _outermost_chains(tree: ast.AST) -> Iterator[tuple[int, list[str]]]:
    """``(line, parts)`` of each dotted name in ``tree``, the longest chain only (``a.b.c``,
    not also ``a.b``)."""
    inner: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            value = node.value
            while isinstance(value, ast.Attribute):
                inner.add(id(value))
                value = value.value
            parts = _dotted(node)
            if parts is not None:
                yield node.lineno, parts


def _bound_here(tree: ast.AST) -> set[str]:
    """Names the block binds other than by importing them."""
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return bound


def _import(module: str) -> Any:
    """The module, or ``_MISSING`` where it cannot be imported."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return _MISSING


def _ours(module: str) -> bool:
    return module.split(".")[0] in PACKAGES


def _instance_attribute(cls: type, name: str) -> bool:
    """Whether instances of ``cls`` have ``name`` though the class does not: annotated in a
    class body, or assigned as ``self.<name>`` in an ``__init__`` of ``cls`` or a base."""
    for klass in inspect.getmro(cls):
        if name in getattr(klass, "__annotations__", {}) or name in getattr(klass, "__slots__", ()):
            return True
        init = klass.__dict__.get("__init__")
        if init is None or not inspect.isfunction(init):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr == name
                    and isinstance(node.value, ast.Name) and node.value.id == "self"):
                return True
    return False


def _attribute(obj: Any, part: str) -> Any:
    """``obj.part``, importing a submodule of a package; ``_MISSING`` where there is none."""
    found = getattr(obj, part, _MISSING)
    if found is _MISSING and isinstance(obj, ModuleType) and hasattr(obj, "__path__"):
        found = _import(f"{obj.__name__}.{part}")
    return found


def _roots(tree: ast.AST, module: ModuleType) -> dict[str, Any]:
    """What each checked first part of a name stands for (``_MISSING`` where it does not
    exist), and, for imports of the packages that fail, the import itself."""
    roots: dict[str, Any] = {name: _import(name) for name in PACKAGES}
    for package in PUBLIC:
        found = _import(package)
        roots.update({name: getattr(found, name) for name in getattr(found, "__all__", ())})
    roots.update({name: value for name, value in vars(module).items() if not name.startswith("__")})
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.name if alias.asname else alias.name.split(".")[0]  # what the name binds
                found = _import(name)
                # a user's module that is not installed here is not ours to check
                roots[alias.asname or name] = found if found is not _MISSING or _ours(name) else None
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            base = _import(node.module)
            if base is _MISSING and not _ours(node.module):
                for alias in node.names:
                    roots[alias.asname or alias.name] = None  # a user's module: not ours to check
                continue
            for alias in node.names:
                roots[alias.asname or alias.name] = _MISSING if base is _MISSING else _attribute(base, alias.name)
    return roots


def unresolved_names(block: Block) -> list[str]:
    """``"line N: a.b.c"`` for each name of the (Python) block that should resolve and does
    not (see the module docstring); for an import, the imported name."""
    tree = parse(block)
    if tree is None:
        return []
    module = importlib.import_module(block.module)
    roots = _roots(tree, module)
    bound = _bound_here(tree)
    found: list[str] = []
    for node in ast.walk(tree):  # the imports themselves
        if isinstance(node, ast.ImportFrom) and node.module and not node.level and _ours(node.module):
            for alias in node.names:
                if roots.get(alias.asname or alias.name) is _MISSING:
                    found.append(f"line {block.line + node.lineno}: {node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _ours(alias.name) and _import(alias.name) is _MISSING:
                    found.append(f"line {block.line + node.lineno}: {alias.name}")
    for node in ast.walk(tree):  # class names from nowhere
        if (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and _CLASS_NAME.match(node.id)
                and node.id not in bound and node.id not in roots and not hasattr(builtins, node.id)):
            found.append(f"line {block.line + node.lineno}: {node.id}")
    for line, parts in _outermost_chains(tree):
        first = parts[0]
        if first in bound:
            continue
        if first in roots:
            obj = roots[first]
        elif first == ALIAS and (parts[1][0].isupper() or parts[1][0] == "_"):
            obj = _import(ALIASED)
        else:
            continue
        if obj is None:
            continue
        for i, part in enumerate(parts[1:], 1):
            if obj is _MISSING:
                break
            owner, obj = obj, _attribute(obj, part)
            if obj is _MISSING and isinstance(owner, type) and _instance_attribute(owner, part):
                obj = None  # an instance's attribute, named through its class: nothing more to check
                break
            if obj is None:
                break
        if obj is _MISSING:
            found.append(f"line {block.line + line}: {'.'.join(parts[: i + 1])}")
    return found


def expected_doctest_examples(path: Path) -> int:
    """How many ``>>>`` examples the docstrings of ``path`` hold (a ``>>>`` line of a comment
    alone is none)."""
    parser = doctest.DocTestParser()
    return sum(len(parser.get_examples(doc)) for _, doc in _docstrings(ast.parse(path.read_text())))


def run_doctests(module_name: str) -> tuple[int, int, str]:
    """``(examples run, failed, report)`` of the module's ``>>>`` examples, run under doctest
    in the module's own namespace."""
    module = importlib.import_module(module_name)
    report: list[str] = []
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in doctest.DocTestFinder(exclude_empty=True).find(module, module_name):
        runner.run(test, out=report.append)
    return runner.tries, runner.failures, "".join(report)
