"""A rank's SIGINT handler (rpc_backend/_local_rank.py): the first SIGINT is Python's
KeyboardInterrupt; a second one, which ``timeout`` and some shells send again to the whole
process group, must not interrupt the rank's report of the first (chained tracebacks)."""

import os
import subprocess
import sys

from tests._deadlines import HANG_S

_CHILD = r"""
import os, signal
from rpc_backend._local_rank import interrupt_once
signal.signal(signal.SIGINT, interrupt_once)
try:
    os.kill(os.getpid(), signal.SIGINT)
    signal.pause()  # not reached: the handler raises first
except KeyboardInterrupt:
    os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C, while the first is handled
    print("reported", signal.getsignal(signal.SIGINT) is signal.SIG_IGN, flush=True)
"""


def test_a_ranks_second_sigint_does_not_interrupt_its_report_of_the_first():
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=HANG_S,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["reported", "True"], (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
