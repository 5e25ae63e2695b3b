"""Render RemoteModule's ``forward``/``forward_async`` from the templates in ``templates/``.

Two renderings:

* :func:`render_forward_methods` fills ``forward.py.tpl`` with the module's real ``forward``
  signature (``inspect.signature``), so ``help()``, IDEs and argument binding see the real
  parameters and a wrong call raises ``TypeError`` on the caller before anything is sent.
* :func:`render_scriptable_module` fills ``scriptable_forward.py.tpl`` from a
  ``@torch.jit.interface`` class, giving TorchScript-compilable methods and the host-side
  script function ``_remote_forward``. Called from Python, those methods take the proxy's
  ordinary call path; TorchScript compiles only their ``torch.jit.is_scripting()`` branch
  (an ``rpc_async`` of ``_remote_forward`` with the proxy's timeout).

Generated source is registered with :mod:`linecache` so ``inspect.getsource`` (and hence
TorchScript and ``help``) can read it.
"""

from __future__ import annotations

import hashlib
import inspect
import linecache
import sys
import types
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Callable

from torch.futures import Future

from remote_module._torch_private import interface_forward_schema, is_jit_interface

_GENERATED_PACKAGE = "remote_module._generated"


@lru_cache(maxsize=None)
def template_text(name: str) -> str:
    """The text of ``templates/<name>``: from the source checkout this package was imported
    from, when it was (``templates/`` beside the package, ``setup.cfg`` above), else from the
    installed ``remote_module._templates``.

    The checkout comes first so code and templates always come from the same tree: an
    editable install maps ``remote_module._templates`` to the checkout it was made from, which
    need not be the one (a second worktree, ``PYTHONPATH``) the package was imported from.
    """
    root = Path(__file__).resolve().parent.parent
    if (root / "setup.cfg").is_file() and (root / "templates" / name).is_file():
        return (root / "templates" / name).read_text()
    return resources.files("remote_module._templates").joinpath(name).read_text()


def _compile(source: str, filename: str, namespace: dict) -> dict:
    lines = source.splitlines(keepends=True)
    # mtime None: linecache keeps the entry (it cannot be checked against a file on disk).
    linecache.cache[filename] = (len(source), None, lines, filename)
    exec(compile(source, filename, "exec", dont_inherit=True), namespace)
    return namespace


# ----------------------------------------------------------------------------------------
# Plain (non-scriptable) proxies.


def forward_signature(module_cls: Any) -> inspect.Signature | None:
    """The signature of ``module_cls.forward`` without ``self``, or None when unknown."""
    forward = getattr(module_cls, "forward", None)
    if forward is None:
        return None
    try:
        sig = inspect.signature(forward)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())
    if isinstance(module_cls, type) and params and params[0].kind in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    ):
        params = params[1:]  # unbound function: drop self
    return sig.replace(parameters=params)


def render_forward_methods(
    sig: inspect.Signature | None, origin: str
) -> tuple[Callable[..., Any], Callable[..., Future]]:
    """Build ``forward`` and ``forward_async`` functions (first parameter: the proxy).

    With ``sig`` None they take ``(*args, **kwargs)``. The functions call
    ``proxy._remote_call_sync(args, kwargs)`` / ``proxy._remote_call_async(args, kwargs)``
    with the bound arguments, so defaults are filled in on the caller.

    Example::

        >>> fwd, fwd_async = render_forward_methods(inspect.signature(lambda x, k=2: x), "f")
        >>> str(inspect.signature(fwd))
        '(_rm_self, x, k=2)'
    """
    if sig is None:
        sig = inspect.Signature(
            [
                inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
                inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD),
            ]
        )
    namespace: dict[str, Any] = {"__name__": _GENERATED_PACKAGE, "_rm_Future": Future}
    params, positional, keywords = [], [], []
    saw_kw_only_marker = False
    P = inspect.Parameter
    plist = list(sig.parameters.values())
    for i, p in enumerate(plist):
        if not p.name.isidentifier() or p.name.startswith("_rm_"):
            raise ValueError(f"cannot generate forward for parameter name {p.name!r} in {origin}")
        text = p.name
        if p.kind is P.VAR_POSITIONAL:
            text = "*" + text
            saw_kw_only_marker = True
            positional.append(f"*{p.name}")
        elif p.kind is P.VAR_KEYWORD:
            text = "**" + text
            keywords.append(f"**{p.name}")
        elif p.kind is P.KEYWORD_ONLY:
            if not saw_kw_only_marker:
                params.append("*")
                saw_kw_only_marker = True
            keywords.append(f"{p.name!r}: {p.name}")
        else:
            positional.append(p.name)
        if p.annotation is not P.empty:
            namespace[f"_rm_a{i}"] = p.annotation
            text += f": _rm_a{i}"
        if p.default is not P.empty:
            namespace[f"_rm_d{i}"] = p.default
            text += f" = _rm_d{i}"
        params.append(text)
        last_pos_only = p.kind is P.POSITIONAL_ONLY and (
            i + 1 == len(plist) or plist[i + 1].kind is not P.POSITIONAL_ONLY
        )
        if last_pos_only:
            params.append("/")
    return_annotation = future_annotation = " -> _rm_Future"
    if sig.return_annotation is not inspect.Signature.empty:
        namespace["_rm_ret"] = sig.return_annotation
        return_annotation = " -> _rm_ret"
        try:
            namespace["_rm_fut"] = Future[sig.return_annotation]
            future_annotation = " -> _rm_fut"
        except TypeError:
            pass
    else:
        return_annotation = ""
    source = template_text("forward.py.tpl").format(
        origin=origin,
        params="".join(", " + t for t in params),
        positional="".join(t + ", " for t in positional),
        keywords=", ".join(keywords),
        return_annotation=return_annotation,
        future_annotation=future_annotation,
    )
    digest = hashlib.sha1(source.encode()).hexdigest()[:12]
    ns = _compile(source, f"<remote_module forward {origin} {digest}>", namespace)
    return ns["forward"], ns["forward_async"]


# ----------------------------------------------------------------------------------------
# TorchScript-compatible proxies.


def _type_str(t: Any) -> str:
    return t.annotation_str


def _map_expr(expr: str, t: Any, leaf: str, depth: int = 0) -> str | None:
    """A TorchScript expression applying ``leaf`` (a format string) to every tensor of ``expr``.

    None when the type holds no tensor (or a structure this generator does not walk:
    such values are passed through as they are).
    """
    kind = t.kind()
    if kind == "TensorType":
        return leaf.format(expr)
    if kind == "TupleType":
        parts = [_map_expr(f"{expr}[{i}]", e, leaf, depth + 1) for i, e in enumerate(t.elements())]
        if all(p is None for p in parts):
            return None
        items = [p if p is not None else f"{expr}[{i}]" for i, p in enumerate(parts)]
        return "(" + "".join(item + ", " for item in items) + ")"
    if kind == "ListType":
        var = f"_rm_v{depth}"
        inner = _map_expr(var, t.getElementType(), leaf, depth + 1)
        return None if inner is None else f"[{inner} for {var} in {expr}]"
    if kind == "DictType":
        k, v = f"_rm_k{depth}", f"_rm_v{depth}"
        inner = _map_expr(v, t.getValueType(), leaf, depth + 1)
        return None if inner is None else f"{{{k}: {inner} for {k}, {v} in {expr}.items()}}"
    return None


def _scriptable_module_name(interface_cls: type) -> str:
    qual = f"{interface_cls.__module__}.{interface_cls.__qualname__}"
    safe = "".join(c if c.isalnum() else "_" for c in qual)
    return f"{_GENERATED_PACKAGE}.{safe}"


def render_scriptable_module(interface_cls: type) -> types.ModuleType:
    """Compile (once per process) the scriptable template for ``interface_cls``.

    The result defines ``forward``, ``forward_async`` (to bind to a proxy) and the script
    function ``_remote_forward``. Its module name depends only on the interface, so caller
    and host agree on the qualified name RPC uses to find ``_remote_forward``.
    """
    if not is_jit_interface(interface_cls):
        raise ValueError(
            "_module_interface_cls must be a class decorated with @torch.jit.interface, "
            f"got {interface_cls!r}"
        )
    if "." in interface_cls.__qualname__:
        raise ValueError(
            f"_module_interface_cls {interface_cls.__qualname__} must be defined at the top level "
            f"of module {interface_cls.__module__} so both workers can import it"
        )
    name = _scriptable_module_name(interface_cls)
    existing = sys.modules.get(name)
    if existing is not None:
        return existing
    schema = interface_forward_schema(interface_cls)
    py_sig = inspect.signature(interface_cls.forward)
    py_params = list(py_sig.parameters.values())[1:]
    args = list(schema.arguments)[1:]
    if len(schema.returns) != 1:
        raise ValueError(f"{interface_cls.__qualname__}.forward must return exactly one value")
    ret_type = schema.returns[0].type
    typed, names, move_in = [], [], []
    for a, p in zip(args, py_params):
        text = f"{a.name}: {_type_str(a.type)}"
        if p.default is not inspect.Parameter.empty:
            text += f" = {p.default!r}"
        typed.append(text)
        names.append(a.name)
        moved = _map_expr(a.name, a.type, "_rm_to_device({}, dev)")
        if moved is not None:
            move_in.append(f"        {a.name} = {moved}")
    move_inputs = "    if dev.type != \"cpu\":\n" + ("\n".join(move_in) if move_in else "        pass")
    out_cpu = _map_expr("out", ret_type, "_rm_to_cpu({})")
    if out_cpu is None:
        move_output = "    return out"
    else:
        move_output = (
            "    if dev.type == \"cpu\" or is_device_map_set:\n"
            "        return out\n"
            f"    return {out_cpu}"
        )
    ret = _type_str(ret_type)
    source = template_text("scriptable_forward.py.tpl").format(
        interface=f"{interface_cls.__module__}.{interface_cls.__qualname__}",
        interface_module=interface_cls.__module__,
        interface_name=interface_cls.__qualname__,
        typed_params="".join(", " + t for t in typed),
        arg_names="".join(", " + n for n in names),
        positional="".join(n + ", " for n in names),
        call_args=", ".join(names),
        return_annotation=f" -> {ret}",
        future_annotation=f" -> Future[{ret}]",
        move_inputs=move_inputs,
        move_output=move_output,
    )
    module = types.ModuleType(name)
    module.__file__ = f"<remote_module scriptable {name}>"
    sys.modules[name] = module
    try:
        _compile(source, module.__file__, module.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    return module
