"""The code passes ``ruff check`` (its configuration: [tool.ruff] in pyproject.toml), so that CI,
which runs the test suite, also runs the linter."""

import subprocess
import sys
from pathlib import Path

from tests._deadlines import HANG_S

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_check_passes():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], cwd=ROOT,
                          capture_output=True, text=True, timeout=HANG_S)  # a hang guard
    assert "No module named ruff" not in done.stderr, "ruff is in the test extra: pip install -e '.[test]'"
    assert done.returncode == 0, done.stdout + done.stderr
