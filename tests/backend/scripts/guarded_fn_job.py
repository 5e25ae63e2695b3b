"""A script that sends run_local a function defined under ``if __name__ == "__main__":``
(which the ranks, importing the script as ``__mp_main__``, never run), or, with ``top``, one
defined at its top level inside an ordinary block (which they do run)."""

import sys

from rpc_backend import run_local

if sys.version_info >= (3,):
    def top_work() -> int:
        return 7

if __name__ == "__main__":
    def guarded_work() -> int:
        return 7

    try:
        print("RESULT", run_local(top_work if sys.argv[1:] == ["top"] else guarded_work, 2, timeout=600,
                                  rpc_timeout=600))  # SETUP_S (tests/_deadlines.py)
    except TypeError as exc:
        print("REFUSED", exc)
