"""The layer rules of shared/DESIGN.md, read from the source with ``ast`` (used by test_layers.py).

Bottom up: ``rpc_backend`` (worlds), ``remote_module._core`` (machinery every layer may use),
``remote_module._proxy`` (what only RemoteModule uses), ``remote_module.remote_module`` (the
proxy), then ``pipeline``, ``sharded``, ``ps`` and ``serving``, and ``demos`` on top. :func:`violations`
returns one line per broken rule:

- ``rpc_backend`` imports nothing of ``remote_module``;
- ``_core`` imports nothing of ``remote_module`` above it;
- ``_proxy`` imports ``_core`` only through its public names and never a layer above it;
- ``pipeline``, ``sharded``, ``ps`` and ``serving`` never import each other, and import ``_core`` and
  ``_proxy`` only as ``from remote_module._core import <a name in its __all__>``; no other
  private module of the package (``remote_module._x``) and no layer's private modules;
- ``demos`` use public names only;
- torch's private names (``torch._C``, ``rpc._is_current_rpc_agent_set``, the modules
  ``torch.distributed.rpc.api`` and ``.internal``) appear only in the ``_torch_private.py``
  files.

ps/'s inner map (``remote_module/ps/__init__.py`` says it too), by the part a module sits in:
``ps/`` itself (its ``__init__.py`` gives the public names and may import every part),
``shared`` (``ps/_*.py``: placement, options, modes, row-wise optimizers, the PS optimizer, the
step transport), ``dense`` (``ps/dense/``: PSModel, its checkpoints, its server), ``tables``
(``ps/tables/*.py``: the trainer side of the tables), ``tables/server`` (``ps/tables/server/``:
table state, handlers, rows, initial rows, pooling, memory), ``tables/lifetime``
(``ps/tables/lifetime/``: admission, eviction, deltas) and ``checkpoint`` (``ps/checkpoint/``:
shard checkpoints of what lives on servers, and the job's checkpointer). Within ps/, a module imports:

- ``shared``: shared modules only;
- ``dense``: shared and dense modules (never tables/: what both need is a shared module);
- ``tables``: shared modules and any of tables/ (its server and lifetime parts included);
- ``tables/server``: shared, tables/server and tables/lifetime modules, never the trainer side;
- ``tables/lifetime``: lifetime modules, row storage (``tables/server/_rows.py``) and initial
  rows (``tables/server/_initial.py``) only;
- ``checkpoint``: any part of ps/ (it saves both dense/'s and tables/' state); no other part
  imports it;
- and none of them ``remote_module.ps`` itself (its public names lead to every part).

Every import counts, also one inside a function, a relative one (``from .._core import x``),
``from remote_module import sharded`` (a module named after ``import``) and
``importlib.import_module("...")`` with a literal name.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

UPPER = ("pipeline", "sharded", "ps", "serving")
INTERNAL = ("_core", "_proxy")
DEMOS = ("demos",)  # the demos
TORCH_PRIVATE_MODULES = ("torch.distributed.rpc.api", "torch.distributed.rpc.internal")


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _layer(rel: tuple[str, ...]) -> str:
    """The layer of a file, from its path relative to the source root."""
    if rel[0] == "rpc_backend":
        return "rpc_backend"
    if len(rel) == 2:
        return "proxy" if rel[1] == "remote_module.py" else "package"  # __init__, old demo shims
    return rel[1]  # _core, _proxy, pipeline, sharded, ps, demos, _templates


def _is_module(root: Path, module: str) -> bool:
    """Whether ``module`` (dotted) is a module or package in the source under ``root``."""
    path = root.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(
    tree: ast.AST, rel: tuple[str, ...] = (), root: Path | None = None
) -> Iterator[tuple[int, str, list[str]]]:
    """``(line, module, names)`` of every import; ``names`` empty for ``import x``.

    Relative imports are resolved against ``rel`` (the file's path under ``root``), and a
    module named in ``from package import module`` counts as ``import package.module`` (so
    ``from remote_module import sharded`` is an import of ``remote_module.sharded``)."""
    package = rel[:-1] if rel else ()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if not package or node.level > len(package):
                    continue  # outside the packages: not ours to check
                base = list(package[: len(package) - (node.level - 1)])
                module = ".".join(base + ([node.module] if node.module else []))
            elif node.module:
                module = node.module
            else:
                continue
            names = [a.name for a in node.names]
            submodules = [n for n in names if root is not None and n != "*" and _is_module(root, f"{module}.{n}")]
            for name in submodules:
                yield node.lineno, f"{module}.{name}", []
            rest = [n for n in names if n not in submodules]
            if rest or not names:
                yield node.lineno, module, rest
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            # importlib.import_module("remote_module._proxy.wire"), __import__("..."): a literal name
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                yield node.lineno, node.args[0].value, []


def _public_names(root: Path, package: str) -> set[str]:
    """The names in ``remote_module/<package>/__init__.py``'s ``__all__``."""
    tree = ast.parse((root / "remote_module" / package / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def _check_import(layer: str, module: str, names: list[str], public: dict[str, set[str]]) -> str | None:
    """Why this import breaks a rule, or None."""
    parts = module.split(".")
    if parts[0] != "remote_module":
        return None
    if layer == "rpc_backend":
        return "rpc_backend imports nothing of remote_module"
    below = parts[1] if len(parts) > 1 else None
    if layer == "_core":
        return None if below == "_core" else "_core imports nothing above it"
    if layer == "_proxy" and below not in ("_core", "_proxy"):
        return "_proxy imports nothing above it (only _core's public names and _proxy)"
    if layer == "proxy":  # remote_module.py: the proxy itself, built on _proxy's modules
        if below not in (None, "_core", "_proxy", "remote_module"):
            return "the proxy imports nothing above it"
        if below == "_proxy":
            return None
    if below in INTERNAL and layer not in INTERNAL:
        if len(parts) > 2:
            return f"import {below}'s public names from remote_module.{below}, not its modules"
        hidden = sorted(set(names) - public[below])
        if hidden or not names:
            return f"not in remote_module.{below}.__all__: {hidden or module}"
    if layer in ("_proxy", "proxy") and below == "_core" and len(parts) > 2:
        return "import _core's public names from remote_module._core, not its modules"
    if layer in ("_proxy", "proxy") and below == "_core":
        hidden = sorted(set(names) - public["_core"])
        return f"not in remote_module._core.__all__: {hidden}" if hidden else None
    if below in DEMOS and layer not in ("demos", "package"):
        return "nothing below the demos imports them"
    if layer in UPPER or layer == "demos":
        if below in UPPER and below != layer:
            if layer in UPPER:
                return f"{layer} never imports {below}"
            if any(_private(p) for p in parts[2:]):
                return f"demos use public names only, not {module}"
        if below is not None and _private(below) and below not in INTERNAL:
            return f"{module} is private to the proxy or the package"
        if layer == "demos" and below in INTERNAL:
            return "demos use public names only"
    return None


#: ps/'s parts (see the module docstring), and what each may import within ps/
PS_ALLOWED = {
    "shared": ("shared",),
    "dense": ("shared", "dense"),
    "tables": ("shared", "tables", "tables/server", "tables/lifetime"),
    "tables/server": ("shared", "tables/server", "tables/lifetime"),
    "tables/lifetime": ("tables/lifetime",),
    "checkpoint": ("shared", "dense", "tables", "tables/server", "tables/lifetime", "checkpoint"),
}
#: the modules of other parts tables/lifetime may import: row storage and initial rows
LIFETIME_USES = ("remote_module.ps.tables.server._rows", "remote_module.ps.tables.server._initial")
PS_RULES = {
    "shared": "ps/'s shared modules import nothing of dense/, tables/ or checkpoint/",
    "dense": "dense/ never imports tables/ or checkpoint/ (what both use is a shared ps/ module)",
    "tables": "tables/ never imports dense/ or checkpoint/ (what both use is a shared ps/ module)",
    "tables/server": "tables/server/ never imports the trainer side (tables/'s own modules), dense/ or "
                     "checkpoint/",
    "tables/lifetime": "tables/lifetime/ imports only row storage and initial rows (tables/server/_rows.py, "
                       "_initial.py)",
    "checkpoint": "checkpoint/ may import any part of ps/ (none imports it)",
}


def _ps_part(parts: tuple[str, ...] | list[str]) -> str:
    """The part of ps/ that ``parts`` (below ``remote_module/ps``: a file's path or a module's
    dotted name, split) is in: ``ps`` (the package itself), ``shared``, ``dense``, ``tables``,
    ``tables/server``, ``tables/lifetime`` or ``checkpoint``."""
    parts = [p[:-3] if p.endswith(".py") else p for p in parts]
    if not parts or parts == ["__init__"]:
        return "ps"
    if parts[0] == "tables" and len(parts) > 1 and parts[1] in ("server", "lifetime"):
        return f"tables/{parts[1]}"
    if parts[0] in ("dense", "tables", "checkpoint"):
        return parts[0]
    return "shared"


def _check_ps_import(rel: tuple[str, ...], module: str) -> str | None:
    """Why this import, in ps/'s file ``rel``, breaks ps/'s inner map, or None."""
    parts = module.split(".")
    if parts[:2] != ["remote_module", "ps"]:
        return None
    mine = _ps_part(rel[2:])
    if mine == "ps":
        return None
    theirs = _ps_part(parts[2:])
    if theirs == "ps":
        return "ps's modules import each other's modules, not remote_module.ps (its names lead to every part)"
    if theirs in PS_ALLOWED[mine] or (mine == "tables/lifetime" and module in LIFETIME_USES):
        return None
    return PS_RULES[mine]


def _torch_private_uses(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """``(line, name)`` of each use of a private torch name: an import of one, or an attribute
    ``_x`` read from a name bound to a torch module (``import torch.distributed.rpc as rpc``)."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    bound[alias.asname or "torch"] = alias.name if alias.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            for alias in node.names:
                bound.setdefault(alias.asname or alias.name, f"{node.module}.{alias.name}")
    for line, module, names in _imports(tree):
        if module.split(".")[0] != "torch":
            continue
        for full in [module] + [f"{module}.{n}" for n in names]:
            if any(_private(p) for p in full.split(".")) or full.startswith(TORCH_PRIVATE_MODULES):
                yield line, full
                break
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:  # one report per chain
            continue
        chain, base = [node.attr], node.value
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        if isinstance(base, ast.Name) and base.id in bound:
            full = ".".join([bound[base.id], *reversed(chain)])
            if any(_private(p) for p in full.split(".")) or full.startswith(TORCH_PRIVATE_MODULES):
                yield node.lineno, full


# A file's findings by (source root, its path, its text, the public names): the planted
# cases of test_layers.py change one file's text at a time (never which files exist), so the
# other files are not walked again.
_findings: dict[tuple[str, tuple[str, ...], str, tuple[tuple[str, ...], ...]], list[str]] = {}


def _file_violations(root: Path, rel: tuple[str, ...], text: str, public: dict[str, set[str]]) -> list[str]:
    key = (str(root), rel, text, tuple(tuple(sorted(public[name])) for name in INTERNAL))
    if key not in _findings:
        layer = _layer(rel)
        tree = ast.parse(text, "/".join(rel))
        found = []
        for line, module, names in _imports(tree, rel, root):
            why = _check_import(layer, module, names, public)
            if why is None and layer == "ps":
                why = _check_ps_import(rel, module)
            if why:
                found.append(f"{'/'.join(rel)}:{line}: {why} ({module})")
        if rel[-1] != "_torch_private.py":
            for line, name in _torch_private_uses(tree):
                found.append(f"{'/'.join(rel)}:{line}: torch's private {name} outside _torch_private.py")
        _findings[key] = found
    return _findings[key]


def violations(root: Path) -> list[str]:
    """Every broken layer rule under ``root`` (the folder holding remote_module/ and
    rpc_backend/), as ``path:line: rule``."""
    public = {name: _public_names(root, name) for name in INTERNAL}
    found = []
    for package in ("rpc_backend", "remote_module"):
        for path in sorted((root / package).rglob("*.py")):
            found += _file_violations(root, path.relative_to(root).parts, path.read_text(), public)
    return found
