"""Docstring examples run or resolve (issue 43, item 5: an example that cannot run is a bug).

- Every module of ``remote_module`` and ``rpc_backend`` whose docstrings hold ``>>>`` examples
  runs them under doctest, in its own namespace, and every example its docstrings hold is run
  (none is skipped because the finder missed its docstring). An example that needs an RPC
  world is written as an ``Example::`` block instead.
- Every ``Example::`` block is Python, and each name it references that should resolve does
  (see tests/_examples.py for which names are checked, and how).

Both checks find what they check from the source files, so a module added or moved is
covered without a list here; each planted bad example is reported.
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest

import remote_module
from tests import _examples as ex

ROOT = Path(remote_module.__file__).resolve().parent.parent
FILES = ex.source_files(ROOT)

#: Known bad examples, each expected to fail (strict: once fixed, the mark must go and the check
#: holds from then on). None today.
KNOWN_BAD: dict[str, str] = {}


def _params(modules: list[str]) -> list:
    return [pytest.param(m, marks=pytest.mark.xfail(strict=True, reason=KNOWN_BAD[m])) if m in KNOWN_BAD else m
            for m in modules]


def _with_doctests() -> list[str]:
    return [ex.module_name(ROOT, p) for p in FILES if re.search(r"^\s*>>>", p.read_text(), re.M)]


def _with_examples() -> list[str]:
    return [ex.module_name(ROOT, p) for p in FILES if any(True for _ in ex.example_blocks(ROOT, p))]


def _path(module: str) -> Path:
    path = ROOT.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def test_the_checks_find_the_examples():
    # guards the discovery itself: a pattern that found nothing would pass every check below
    assert len(_with_doctests()) >= 15 and len(_with_examples()) >= 50
    assert "remote_module._proxy.idioms" in _with_doctests()
    assert "remote_module.remote_module" in _with_examples()


@pytest.mark.parametrize("module", _with_doctests())
def test_doctest_examples_run(module):
    run, failed, report = ex.run_doctests(module)
    assert failed == 0, report
    assert run == ex.expected_doctest_examples(_path(module)) > 0, f"{module}: some >>> examples were not run"


@pytest.mark.parametrize("module", _params(_with_examples()))
def test_example_blocks_are_python_and_their_names_resolve(module):
    blocks = list(ex.example_blocks(ROOT, _path(module)))
    not_python = [f"line {b.line}: {b.text.strip()[:60]!r}" for b in blocks if ex.parse(b) is None]
    assert not not_python, f"{module}: Example:: blocks that are not Python: {not_python}"
    unresolved = [name for b in blocks for name in ex.unresolved_names(b)]
    assert not unresolved, f"{module}: names in Example:: blocks that do not resolve: {unresolved}"


# ---- planted bad examples are reported ----------------------------------------------------

PLANTED = '''
"""A planted module.

Example::

    from remote_module import RemoteModule, NoSuchThing
    import remote_module.no_such_module
    proxy = RemoteModule("worker1", torch.nn.Linear, (2, 2))
    Known.made_up()                      # the class is here; the method is not
    Known.declared                       # an instance attribute, assigned in __init__
    remote_module.pipeline.NotThere(3)
    rpc_backend.run_local(main, 2)       # fine
    ps.PSModel, ps.Missing               # ps, read as remote_module.ps
    ps.state_dict()                      # a PSModel the example calls ps: not checked
    Unheard.of()                         # a class name from nowhere
    local = Known(); local.anything      # the example's own objects: not checked

Example (doctest style)::

    >>> Known.also_missing
    1
"""

import torch


class Known:
    def __init__(self):
        self.declared = 1
'''


@pytest.fixture
def planted(tmp_path, monkeypatch):
    package = tmp_path / "planted_examples"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "bad.py").write_text(textwrap.dedent(PLANTED).lstrip())
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path, package / "bad.py"
    for name in ("planted_examples.bad", "planted_examples"):  # each test imports its own
        sys.modules.pop(name, None)


def test_a_planted_example_with_names_that_do_not_resolve_is_reported(planted):
    root, path = planted
    blocks = list(ex.example_blocks(root, path))
    assert [b.module for b in blocks] == ["planted_examples.bad"] * 2
    found = [name.split(": ", 1)[1] for b in blocks for name in ex.unresolved_names(b)]
    assert sorted(found) == sorted([
        "remote_module.NoSuchThing",
        "remote_module.no_such_module",
        "Known.made_up",
        "remote_module.pipeline.NotThere",
        "ps.Missing",
        "Unheard",
        "Known.also_missing",
    ]), found


def test_a_planted_example_that_is_not_python_is_reported(planted):
    root, path = planted
    path.write_text('"""Example::\n\n    x = emb.delta_state_dict("ckpt")\n    ...train...\n"""\n')
    (block,) = ex.example_blocks(root, path)
    assert ex.parse(block) is None


def test_a_planted_failing_doctest_is_reported(planted):
    _, path = planted
    path.write_text('"""Example::\n\n    >>> 1 + 1\n    3\n    >>> 2\n    2\n"""\n')
    run, failed, report = ex.run_doctests("planted_examples.bad")
    assert (run, failed) == (2, 1) and "Expected:\n    3\nGot:\n    2" in report, report
    assert ex.expected_doctest_examples(path) == 2
