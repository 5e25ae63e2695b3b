"""Every tutorial runs as its docstring says."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quickstart():
    out = subprocess.run(
        [sys.executable, "tutorials/quickstart.py"], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[(128, 30), (4, 30), 2]"
