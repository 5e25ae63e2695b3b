"""A process that calls run_local and is then signalled or killed (tests/backend/test_lifetime.py).

    python -m tests.backend._lifetime_world PID_DIR MODE

Two ranks write their pids into PID_DIR and wait forever. MODE ``plain`` leaves the signal
handlers as Python sets them; ``own-sigterm`` installs a SIGTERM handler of its own first,
which reports and exits 4. After a KeyboardInterrupt (SIGINT) or in that handler, the process
prints one ``REPORT <json>`` line: whether run_local had already stopped its ranks, and whether
the handlers are back to what they were.
"""

import json
import multiprocessing
import signal
import sys

from rpc_backend import run_local
from tests._deadlines import SETUP_S
from tests.backend import _ranks_remote


def _report(**extra) -> None:
    print("REPORT " + json.dumps({
        "children_left": [p.pid for p in multiprocessing.active_children()],
        "sigint_restored": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        **extra,
    }), flush=True)


def _own_sigterm(signum, frame) -> None:
    _report(sigterm_restored=signal.getsignal(signal.SIGTERM) is _own_sigterm, via="own-sigterm")
    sys.exit(4)


def main(pid_dir: str, mode: str) -> None:
    # Python's own SIGINT handler whatever this process inherited: a shell starts background
    # jobs (`make test &`) with SIGINT ignored, and Python then leaves it ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if mode == "own-sigterm":
        signal.signal(signal.SIGTERM, _own_sigterm)
    try:
        run_local(_ranks_remote.write_pid_and_wait, 2, args=(pid_dir,), rpc_timeout=SETUP_S)
    except KeyboardInterrupt:
        _report(sigterm_restored=signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, via="KeyboardInterrupt")
        sys.exit(3)
    print("run_local returned, which it should not", flush=True)
    sys.exit(5)


if __name__ == "__main__":
    main(*sys.argv[1:])
