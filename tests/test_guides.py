"""The README and the guides in tutorials/*.md show only code that runs.

Every fenced code block is one of:

* marked ``<!-- excerpt: tutorials/<file>.py -->`` on the line before it: an excerpt of a
  tutorial script (which tests/test_tutorials.py runs). Its lines must appear in that file in
  the same order; a line ``...`` marks a gap, and between gaps the lines are consecutive in the
  file (blank lines ignored). Each run of lines may be indented differently from the file, as a
  whole;
* marked ``<!-- runs: tests/test_guides.py -->``: a complete Python program, run here (keep
  these few and cheap: no RPC worlds);
* a shell block (``sh``, ``bash``, ``console``), allowed unmarked (tests/test_torchrun.py runs
  the torchrun commands of tutorials/torchrun.md).

Every relative link in these files points to a file that exists.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "tutorials").glob("*.md"))]
SHELL = {"sh", "bash", "console"}
PYTHON = {"python", "py", "python3"}
MARK = re.compile(r"^<!--\s*(excerpt|runs):\s*(\S+)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)\s*$")
GAP = "..."


class Block(NamedTuple):
    doc: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    mark: tuple[str, str] | None  # ("excerpt", "tutorials/x.py") or ("runs", "tests/test_guides.py")

    @property
    def where(self) -> str:
        doc = self.doc.relative_to(ROOT) if self.doc.is_relative_to(ROOT) else self.doc
        return f"{doc}:{self.line}"


def blocks(doc: Path) -> list[Block]:
    """The fenced code blocks of ``doc``, each with the mark on the line before its fence."""
    lines = doc.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence, lang = opening.groups()
        end = i + 1
        while end < len(lines) and not (lines[end].strip().startswith(fence[0] * len(fence))
                                        and not lines[end].strip().strip(fence[0])):
            end += 1
        assert end < len(lines), f"{doc.relative_to(ROOT)}:{i + 1}: code block never closed"
        body = "\n".join(line[len(indent):] if line.startswith(indent) else line for line in lines[i + 1:end])
        previous = lines[i - 1].strip() if i > 0 else ""
        mark = MARK.match(previous)
        found.append(Block(doc, i + 1, lang.lower(), body + "\n", mark.groups() if mark else None))
        i = end + 1
    return found


ALL = [block for doc in DOCS for block in blocks(doc)]


def _segments(text: str) -> list[list[str]]:
    """The block's non-blank lines, cut at ``...`` lines, each run dedented as a whole."""
    runs: list[list[str]] = [[]]
    for line in text.splitlines():
        if line.strip() == GAP:
            runs.append([])
        elif line.strip():
            runs[-1].append(line.rstrip())
    return [textwrap.dedent("\n".join(run)).splitlines() for run in runs if run]


def _find(run: list[str], source: list[str], start: int) -> int | None:
    """Where ``run`` appears in ``source`` (non-blank lines) at or after ``start``, as
    consecutive lines indented by one common amount; the index after it, or None."""
    for at in range(start, len(source) - len(run) + 1):
        window = source[at:at + len(run)]
        if textwrap.dedent("\n".join(window)).splitlines() == run:
            return at + len(run)
    return None


def check_excerpt(block: Block, root: Path = ROOT) -> None:
    target = root / block.mark[1]
    assert target.is_file(), f"{block.where}: the excerpt's file {block.mark[1]} does not exist"
    source = [line.rstrip() for line in target.read_text().splitlines() if line.strip()]
    at = 0
    for run in _segments(block.text):
        found = _find(run, source, at)
        assert found is not None, (
            f"{block.where}: these lines are not in {block.mark[1]} (consecutively, in this order, after "
            f"the block's earlier lines):\n" + "\n".join(run)
        )
        at = found


def test_docs_are_found():
    names = {doc.name for doc in DOCS}
    assert {"README.md", "torchrun.md", "pipelines.md", "sharded.md", "parameter-servers.md", "embeddings.md",
            "performance.md", "security.md"} <= names


def test_every_block_is_an_excerpt_runs_here_or_is_shell():
    bad = []
    for block in ALL:
        if block.mark is not None:
            kind, target = block.mark
            if kind == "runs" and target != "tests/test_guides.py":
                bad.append(f"{block.where}: marked to run in {target}; only tests/test_guides.py runs blocks")
            if kind == "runs" and block.lang not in PYTHON:
                bad.append(f"{block.where}: marked runs but is a {block.lang or 'plain'} block, not python")
            if kind == "excerpt" and not (target.startswith("tutorials/") and target.endswith(".py")):
                bad.append(f"{block.where}: an excerpt of {target}; excerpts come from tutorials/*.py")
        elif block.lang not in SHELL:
            bad.append(f"{block.where}: a {block.lang or 'plain'} block that is neither marked "
                       "<!-- excerpt: tutorials/<file>.py --> nor <!-- runs: tests/test_guides.py -->")
    assert not bad, "\n".join(bad)


EXCERPTS = [block for block in ALL if block.mark and block.mark[0] == "excerpt"]
RUNS = [block for block in ALL if block.mark and block.mark[0] == "runs"]


def test_there_are_excerpts_and_runnable_blocks():
    assert EXCERPTS and RUNS
    assert any(block.doc.name == "README.md" for block in EXCERPTS)  # the README's example


@pytest.mark.parametrize("block", EXCERPTS, ids=[block.where for block in EXCERPTS])
def test_excerpt_is_in_its_tutorial(block):
    check_excerpt(block)


@pytest.mark.parametrize("block", RUNS, ids=[block.where for block in RUNS])
def test_runnable_block_runs(block, monkeypatch):
    # a guide's program runs as a script would, in a process of no RPC world; this pytest
    # process may be a rank of the test session's own world (tests/conftest.py), which a
    # Checkpointer would see (and ask for trainers=)
    from remote_module.ps.checkpoint import _checkpointer

    monkeypatch.setattr(_checkpointer, "_in_rpc_world", lambda: False)
    exec(compile(block.text, block.where, "exec"), {"__name__": "__guide__"})


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _links(doc: Path) -> list[tuple[int, str]]:
    """Relative link targets outside code blocks: (line, target without its #fragment)."""
    found, fence = [], None
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        opening = FENCE.match(line)
        if opening and fence is None:
            fence = opening.group(2)[0]
            continue
        if fence is not None:
            if line.strip().startswith(fence * 3) and not line.strip().strip(fence):
                fence = None
            continue
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL, mailto:, or a link inside this page
            found.append((n, target.split("#", 1)[0]))
    return found


@pytest.mark.parametrize("doc", DOCS, ids=[str(doc.relative_to(ROOT)) for doc in DOCS])
def test_relative_links_point_to_files_that_exist(doc):
    missing = [f"{doc.relative_to(ROOT)}:{n}: {target}" for n, target in _links(doc)
               if not (doc.parent / target).exists()]
    assert not missing, "\n".join(missing)


def test_readme_links_every_guide():
    readme = {target for _, target in _links(ROOT / "README.md")}
    guides = {f"tutorials/{doc.name}" for doc in DOCS if doc.parent.name == "tutorials"}
    assert guides <= readme, sorted(guides - readme)


#: each capability's guide and the tutorial script it links to, beside it
GUIDE_SCRIPTS = {
    "remote-module.md": "quickstart.py", "pipelines.md": "pipeline.py", "sharded.md": "sharded.py",
    "parameter-servers.md": "parameter_server.py", "embeddings.md": "embeddings.py", "serving.md": "serving.py",
}


@pytest.mark.parametrize("guide, script", GUIDE_SCRIPTS.items())
def test_guide_links_its_tutorial_script(guide, script):
    assert (ROOT / "tutorials" / script).is_file()
    assert script in {target for _, target in _links(ROOT / "tutorials" / guide)}


def test_readme_opens_with_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    first = next(block for block in blocks(ROOT / "README.md"))
    assert first.lang in SHELL
    commands = [line.split("#")[0].strip() for line in first.text.splitlines() if line.strip()]
    assert commands == ["make demo", "make test"], first.text
    assert readme.index("make demo") < readme.index("## ")  # in the opening, before any section
    assert len(readme.splitlines()) <= 200


# ---- the checker itself -------------------------------------------------------------------------


def _excerpt(text: str, source: str, tmp_path: Path) -> None:
    target = tmp_path / "tutorials" / "x.py"
    target.parent.mkdir(exist_ok=True)
    target.write_text(source)
    check_excerpt(Block(tmp_path / "doc.md", 1, "python", text, ("excerpt", "tutorials/x.py")), root=tmp_path)


SOURCE = """\
def f():
    a = 1

    b = 2
    return a + b


def g():
    return 3
"""


def test_checker_accepts_reindented_runs_and_gaps(tmp_path):
    _excerpt("a = 1\nb = 2\n", SOURCE, tmp_path)
    _excerpt("def f():\n    a = 1\n...\n    return a + b\n...\ndef g():\n", SOURCE, tmp_path)


@pytest.mark.parametrize("text", [
    "a = 1\nreturn a + b\n",  # a gap not marked with ...
    "b = 2\n...\na = 1\n",  # out of order
    "a = 1\n  b = 2\n",  # relative indentation changed
    "a = 2\n",  # not in the file
], ids=["unmarked-gap", "out-of-order", "indentation", "absent"])
def test_checker_refuses(text, tmp_path):
    with pytest.raises(AssertionError):
        _excerpt(text, SOURCE, tmp_path)


def test_blocks_and_marks_are_parsed(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("text\n<!-- runs: tests/test_guides.py -->\n```python\nx = 1\n```\n\n```sh\nls\n```\n"
                   "<!-- excerpt: tutorials/a.py -->\n  ```python\n  y = 2\n  ```\n")
    found = blocks(doc)
    assert [(b.lang, b.text, b.mark) for b in found] == [
        ("python", "x = 1\n", ("runs", "tests/test_guides.py")),
        ("sh", "ls\n", None),
        ("python", "y = 2\n", ("excerpt", "tutorials/a.py")),
    ]
