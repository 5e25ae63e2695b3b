"""`pip install .` into a clean virtual environment gives remote_module and rpc_backend with
every subpackage, the templates inside the package (remote_module._templates) and no top-level
`templates`; it works whatever setuptools the interpreter has (old ones cannot build wheels
without build isolation)."""

import json
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: what a build of the project reads; copied so the build never writes into the checkout
SOURCES = ("setup.cfg", "pyproject.toml", "README.md", "remote_module", "rpc_backend", "templates")
#: subpackages added to the copy only: discovery must find packages nobody listed
PROBE_SUBPACKAGES = ("remote_module._probe_sub", "remote_module._probe_sub.deeper", "rpc_backend._probe_sub")

PROBE = r"""
import importlib.util, json, sys
import remote_module, rpc_backend, remote_module._templates
from remote_module._codegen import template_text
expected = json.loads(sys.argv[1])
print(json.dumps({
    "remote_module": remote_module.__file__,
    "templates_pkg": remote_module._templates.__file__,
    "top_level_templates": importlib.util.find_spec("templates") is not None,
    "template_ok": "def forward(" in template_text("forward.py.tpl"),
    "packages": {name: getattr(importlib.util.find_spec(name), "origin", None) for name in expected},
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


def _install_flags(python: Path) -> list[str]:
    """Build isolation off only when the target interpreter can build wheels itself; otherwise
    pip builds in an isolated environment with pyproject's ``setuptools>=64``."""
    can = subprocess.run([str(python), "-c", CAN_BUILD_WHEELS], capture_output=True).returncode == 0
    return ["--no-build-isolation"] if can else []


def _pip_supports_python_flag() -> bool:
    out = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True).stdout
    major, minor = (int(x) for x in out.split()[1].split(".")[:2])
    return (major, minor) >= (22, 3)


def _install(env_dir: Path, project: Path, cwd: Path) -> None:
    python = env_dir / "bin" / "python"
    flags = ["install", "--quiet", "--no-deps", *_install_flags(python), str(project)]
    command = (
        [sys.executable, "-m", "pip", "--python", str(python), *flags]
        if _pip_supports_python_flag()
        else [sys.executable, "-m", "pip", *flags, "--prefix", str(env_dir)]
    )
    out = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    assert out.returncode == 0, f"{command}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"


def test_package_dirs_lists_every_package_of_the_checkout():
    names = package_dirs(ROOT)
    assert names[:1] == ["remote_module"] and "rpc_backend" in names
    assert all(not name.startswith("templates") for name in names)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "own_setuptools",
    [False, True],
    ids=["interpreter-setuptools", "venv-with-old-bundled-setuptools"],
)
def test_pip_install_into_a_clean_venv(tmp_path, own_setuptools):
    # system site packages give the venv torch without a download. With own_setuptools the
    # venv also gets ensurepip's bundled setuptools, which shadows the system one: on Python
    # 3.11 that is 65.5 without `wheel`, the setup a fresh `python3 -m venv` has.
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=own_setuptools).create(env_dir)
    project = _project_copy(tmp_path / "project")
    expected = package_dirs(project) + ["remote_module._templates"]
    assert set(PROBE_SUBPACKAGES) <= set(expected)
    _install(env_dir, project, cwd=tmp_path)
    out = subprocess.run([str(env_dir / "bin" / "python"), "-c", PROBE, json.dumps(expected)],
                         cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    info = json.loads(out.stdout)
    assert info["remote_module"].startswith(str(env_dir)), info
    assert info["templates_pkg"].startswith(str(env_dir)), info
    assert info["top_level_templates"] is False
    assert info["template_ok"] is True
    # every package directory, including ones no configuration names, was installed
    missing = {name: origin for name, origin in info["packages"].items() if not (origin or "").startswith(str(env_dir))}
    assert missing == {}, info["packages"]
