"""`pip install .` into a clean virtual environment gives remote_module and rpc_backend, with the
templates inside the package (remote_module._templates) and no top-level `templates`."""

import json
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PROBE = r"""
import importlib.util, json, sys
import remote_module, rpc_backend, remote_module._templates
from remote_module._codegen import template_text
print(json.dumps({
    "remote_module": remote_module.__file__,
    "templates_pkg": remote_module._templates.__file__,
    "top_level_templates": importlib.util.find_spec("templates") is not None,
    "template_ok": "def forward(" in template_text("forward.py.tpl"),
    "prefix": sys.prefix,
}))
"""


@pytest.mark.timeout(300)
def test_pip_install_into_a_clean_venv(tmp_path):
    env_dir = tmp_path / "venv"
    # system site packages give it torch without a download; the project itself is installed
    # into the venv, without its dependencies and without build isolation (no network needed).
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
         "--no-build-isolation", str(ROOT)]
        if _pip_supports_python_flag()
        else [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
              "--prefix", str(env_dir), str(ROOT)],
        check=True,
        cwd=tmp_path,
    )
    out = subprocess.run([str(python), "-c", PROBE], check=True, cwd=tmp_path, capture_output=True, text=True)
    info = json.loads(out.stdout)
    assert info["remote_module"].startswith(str(env_dir)), info
    assert info["templates_pkg"].startswith(str(env_dir)), info
    assert info["top_level_templates"] is False
    assert info["template_ok"] is True


def _pip_supports_python_flag() -> bool:
    out = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True).stdout
    major, minor = (int(x) for x in out.split()[1].split(".")[:2])
    return (major, minor) >= (22, 3)
