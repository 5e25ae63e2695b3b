"""The demos moved to remote_module/demos/; their old module paths (in users' scripts and in
older guides) still import and run them."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests._deadlines import HANG_S, SETUP_S

ROOT = Path(__file__).resolve().parents[2]


def test_the_old_module_paths_are_the_demos_themselves():
    from remote_module import demo, dlrm_demo
    from remote_module.demos import dlrm, hybrid

    assert dlrm_demo is dlrm and demo is hybrid
    assert dlrm_demo.main is dlrm.main and demo.main is hybrid.main


@pytest.mark.slow
@pytest.mark.parametrize("module, args, expected", [
    ("remote_module.demo", ["--steps", "5", "--no-progress"], "loss after"),
    ("remote_module.dlrm_demo", ["--servers", "1", "--trainers", "1", "--steps", "3", "--no-progress", "--plot", ""],
     "mode async, 3 steps"),
])
def test_python_m_the_old_path_runs_the_demo(tmp_path, module, args, expected):
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=SETUP_S + HANG_S)  # a hang guard: the demo starts a world
    assert done.returncode == 0, done.stderr[-3000:]
    assert expected in done.stdout, done.stdout[-3000:]
