"""`pip install .` into a clean virtual environment gives remote_module and rpc_backend with
every subpackage, the templates inside the package (remote_module._templates), no top-level
`templates` and the PEP 561 `py.typed` markers; the Makefile's install works in a fresh venv
whatever setuptools it has (ensurepip's 65.5 without `wheel`, or none at all as on Python
3.12+).

The test venvs never see the base interpreter's packages: torch and the other dependencies
come from the running interpreter's site directories through a `.pth` file (build tools and
this project left out), so nothing here depends on the base interpreter or downloads torch.
Without a setuptools that can build wheels, pip fetches one into an isolated build
environment (PyPI must be reachable then).
"""

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: what a build of the project reads; copied so the build never writes into the checkout
SOURCES = ("setup.cfg", "pyproject.toml", "README.md", "Makefile", "remote_module", "rpc_backend", "templates")
#: subpackages added to the copy only: discovery must find packages nobody listed
PROBE_SUBPACKAGES = ("remote_module._probe_sub", "remote_module._probe_sub.deeper", "rpc_backend._probe_sub")
#: entries of the running interpreter's site directories the test venvs must not see: build
#: tools (the venv's own must decide how the project builds), installers, .pth hooks, and this
#: project itself (an editable install's finder and metadata)
HIDDEN_PREFIXES = (
    "setuptools", "pkg_resources", "_distutils_hack", "distutils-precedence", "wheel", "pip",
    "remote_module", "rpc_backend", "__editable__", "easy-install", "_virtualenv",
)

PROBE = r"""
import importlib.util, json, sys
from pathlib import Path
import remote_module, rpc_backend, remote_module._templates
from remote_module._proxy.codegen import template_text
expected = json.loads(sys.argv[1])
print(json.dumps({
    "remote_module": remote_module.__file__,
    "templates_pkg": remote_module._templates.__file__,
    "top_level_templates": importlib.util.find_spec("templates") is not None,
    "template_ok": "def forward(" in template_text("forward.py.tpl"),
    "packages": {name: getattr(importlib.util.find_spec(name), "origin", None) for name in expected},
    "py_typed": {m.__name__: (Path(m.__file__).parent / "py.typed").is_file() for m in (remote_module, rpc_backend)},
    "prefix": sys.prefix,
}))
"""

#: True when this interpreter's setuptools can build a wheel by itself (bdist_wheel is built
#: into setuptools >= 70.1; from 64 it needs the separate `wheel` package)
CAN_BUILD_WHEELS = r"""
import importlib.util
try:
    import setuptools
except ImportError:
    raise SystemExit(1)
major, minor = (int(part) for part in setuptools.__version__.split(".")[:2])
ok = (major, minor) >= (70, 1) or ((major, minor) >= (64, 0) and importlib.util.find_spec("wheel") is not None)
raise SystemExit(0 if ok else 1)
"""


def package_dirs(root: Path) -> list[str]:
    """Every package directory under remote_module/ and rpc_backend/, as dotted names."""
    found = []
    for top in ("remote_module", "rpc_backend"):
        for init in sorted((root / top).rglob("__init__.py")):
            found.append(".".join(init.parent.relative_to(root).parts))
    return found


def _project_copy(dst: Path) -> Path:
    dst.mkdir()
    for name in SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, dst / name)
    for name in PROBE_SUBPACKAGES:
        package = dst.joinpath(*name.split("."))
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(f"NAME = {name!r}\n")
    return dst


def _site_dirs() -> list[Path]:
    """The running interpreter's site directories, in import order (where its torch lives)."""
    dirs = []
    for entry in sys.path:
        path = Path(entry or ".").resolve()
        if path.name in ("site-packages", "dist-packages") and path.is_dir() and path not in dirs:
            dirs.append(path)
    return dirs


def _dependency_view(dst: Path) -> list[Path]:
    """One folder per site directory of the running interpreter, holding links to everything in
    it but HIDDEN_PREFIXES: torch, numpy, cloudpickle, pytest... without setuptools or this
    project."""
    views = []
    for i, site_dir in enumerate(_site_dirs()):
        view = dst / f"site{i}"
        view.mkdir(parents=True)
        for entry in site_dir.iterdir():
            name = entry.name.lower().replace("-", "_")
            if entry.suffix == ".pth" or any(name.startswith(p.replace("-", "_")) for p in HIDDEN_PREFIXES):
                continue
            (view / entry.name).symlink_to(entry)
        views.append(view)
    return views


def _make_venv(env_dir: Path, views: list[Path], setuptools: bool) -> Path:
    """A venv of the running Python with pip (ensurepip's; its setuptools removed unless
    ``setuptools``), reaching ``views`` through a .pth file, never the base site-packages."""
    venv.EnvBuilder(system_site_packages=False, with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    if not setuptools:
        _run([str(python), "-m", "pip", "uninstall", "--quiet", "--yes", "setuptools"])
    site_packages = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    (site_packages / "_test_dependencies.pth").write_text("".join(f"{view}\n" for view in views))
    return python


def _run(command: list[str], cwd: Path | None = None, env: dict | None = None) -> str:
    out = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    assert out.returncode == 0, f"{command}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def _probe(python: Path, expected: list[str], cwd: Path) -> dict:
    return json.loads(_run([str(python), "-c", PROBE, json.dumps(expected)], cwd=cwd))


def _install_flags(python: Path) -> list[str]:
    """Build isolation off only when the target interpreter can build wheels itself; otherwise
    pip builds in an isolated environment with pyproject's ``setuptools>=64``."""
    can = subprocess.run([str(python), "-c", CAN_BUILD_WHEELS], capture_output=True).returncode == 0
    return ["--no-build-isolation"] if can else []


def test_package_dirs_lists_every_package_of_the_checkout():
    names = package_dirs(ROOT)
    assert names[:1] == ["remote_module"] and "rpc_backend" in names
    assert all(not name.startswith("templates") for name in names)


def test_dependency_view_has_torch_and_hides_build_tools_and_the_project(tmp_path):
    views = _dependency_view(tmp_path)
    names = {entry.name for view in views for entry in view.iterdir()}
    assert "torch" in names
    hidden = {
        n for n in names if n.split("-")[0].lower() in ("setuptools", "wheel", "pip", "remote_module", "rpc_backend")
    }
    assert hidden == set()
    assert not any(n.endswith(".pth") for n in names)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "own_setuptools",
    [False, True],
    ids=["venv-without-setuptools", "venv-with-bundled-setuptools"],
)
def test_pip_install_into_a_clean_venv(tmp_path, own_setuptools):
    # Without own_setuptools the venv has none, as on Python 3.12+; with it, ensurepip's
    # bundled one: on Python 3.11 that is 65.5 without `wheel`, as a fresh `python3 -m venv`.
    env_dir = tmp_path / "venv"
    python = _make_venv(env_dir, _dependency_view(tmp_path / "deps"), own_setuptools)
    project = _project_copy(tmp_path / "project")
    expected = package_dirs(project) + ["remote_module._templates"]
    assert set(PROBE_SUBPACKAGES) <= set(expected)
    before = _probe_environment(python, tmp_path)
    assert before["setuptools"] is own_setuptools
    assert before["torch"].startswith(str(tmp_path / "deps")), before  # not the base interpreter's

    # the Makefile's install, as `make install` runs it (no dependency is fetched: torch comes
    # through the .pth, so the Makefile skips its torch step)
    pip = f"{python} -m pip install --quiet --disable-pip-version-check --no-deps"
    _run(["make", "-C", str(project), "install", f"PYTHON={python}", f"PIP={pip}"], cwd=tmp_path)
    editable = _probe(python, expected, cwd=tmp_path)
    assert editable["remote_module"].startswith(str(project)), editable
    assert editable["template_ok"] is True and editable["top_level_templates"] is False
    assert editable["py_typed"] == {"remote_module": True, "rpc_backend": True}

    # a regular install over it
    _run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", *_install_flags(python), str(project)],
         cwd=tmp_path)
    info = _probe(python, expected, cwd=tmp_path)
    assert info["remote_module"].startswith(str(env_dir)), info
    assert info["templates_pkg"].startswith(str(env_dir)), info
    assert info["top_level_templates"] is False
    assert info["template_ok"] is True
    assert info["py_typed"] == {"remote_module": True, "rpc_backend": True}
    # every package directory, including ones no configuration names, was installed
    missing = {name: origin for name, origin in info["packages"].items() if not (origin or "").startswith(str(env_dir))}
    assert missing == {}, info["packages"]


PROBE_ENVIRONMENT = r"""
import importlib.util, json
print(json.dumps({
    "setuptools": importlib.util.find_spec("setuptools") is not None,
    "torch": importlib.util.find_spec("torch").origin,
    "remote_module": importlib.util.find_spec("remote_module") is not None,
}))
"""


def _probe_environment(python: Path, cwd: Path) -> dict:
    info = json.loads(_run([str(python), "-c", PROBE_ENVIRONMENT], cwd=cwd))
    assert info["remote_module"] is False, "the test venv sees an installed remote_module before installing it"
    return info


#: stands in for pip in the Makefile's install (``PIP=...``): logs its arguments to
#: $FAKE_PIP_LOG and makes what it was asked for importable in the interpreter that called it,
#: as the real install would, through a .pth file in its site-packages: torch from the folders
#: in $FAKE_TORCH_SITE, the project (an editable install) from the directory it runs in
FAKE_PIP = r"""#!/bin/sh
python="$1"; shift
echo "$python $*" >> "$FAKE_PIP_LOG"
site=$("$python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
case "$*" in
  *torch==*) printf '%s\n' $FAKE_TORCH_SITE > "$site/_fake_torch.pth" ;;
  *-e*) pwd > "$site/_fake_editable.pth" ;;
esac
"""


def _bare_venv(env_dir: Path, views: list[Path]) -> Path:
    """A venv without pip (quick to make), seeing ``views`` (torch, or nothing) through a .pth."""
    venv.EnvBuilder(system_site_packages=False, with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site_packages = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    (site_packages / "_test_dependencies.pth").write_text("".join(f"{view}\n" for view in views))
    return python


@pytest.mark.timeout(300)
def test_the_makefile_installs_into_each_interpreter_that_lacks_the_project(tmp_path):
    # The install stamp belongs to an interpreter, not to the checkout: a second venv in the
    # same clone gets its own install (it used to find the first venv's stamp and skip it,
    # and `make demo` failed with ModuleNotFoundError: torch), and so does a venv deleted and
    # made again at the same path. pip is a fake that logs what it was asked to install.
    project = _project_copy(tmp_path / "project")
    fake_pip = tmp_path / "fake-pip"
    fake_pip.write_text(FAKE_PIP)
    fake_pip.chmod(0o755)
    log = tmp_path / "pip.log"
    with_torch = _dependency_view(tmp_path / "deps")
    env = {**os.environ, "FAKE_PIP_LOG": str(log), "FAKE_TORCH_SITE": " ".join(map(str, with_torch))}
    env.pop("PYTHONPATH", None)  # (the venvs must not see the checkout through it)

    def make_install(python: Path) -> tuple[list[str], str]:
        log.write_text("")
        out = subprocess.run(["make", "-C", str(project), "install", f"PYTHON={python}", f"PIP={fake_pip} {python}"],
                             cwd=tmp_path, env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr
        return log.read_text().splitlines(), out.stdout

    first = _bare_venv(tmp_path / "venv1", with_torch)
    installs, _ = make_install(first)
    assert len(installs) == 1 and installs[0].startswith(f"{first} ") and "-e .[test,demo]" in installs[0], installs
    assert make_install(first)[0] == []  # installed: nothing to do

    second = _bare_venv(tmp_path / "venv2", [])  # no torch here
    installs, said = make_install(second)
    assert [line.split()[-1] for line in installs] == ["torch==2.13.0", ".[test,demo]"], installs
    assert "installing torch==2.13.0 (once" in said, said  # a line before the long quiet download
    assert make_install(second)[0] == [] and make_install(first)[0] == []

    shutil.rmtree(tmp_path / "venv1")  # the same path, a new venv: installed again
    first = _bare_venv(tmp_path / "venv1", with_torch)
    installs, _ = make_install(first)
    assert len(installs) == 1 and "-e .[test,demo]" in installs[0], installs


def test_make_demo_passes_args_to_the_demo(tmp_path):
    # the README's `make demo ARGS="--mode sync"`: the demo's own options reach it
    project = _project_copy(tmp_path / "project")
    for target, module in (("demo", "remote_module.demos.dlrm"), ("demo-hybrid", "remote_module.demos.hybrid")):
        out = _run(["make", "-n", "-C", str(project), target, f"PYTHON={sys.executable}", "ARGS=--mode sync --steps 7"],
                   cwd=tmp_path)
        assert f"{sys.executable} -m {module} --mode sync --steps 7" in out.splitlines(), out
