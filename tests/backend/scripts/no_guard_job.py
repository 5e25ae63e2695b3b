"""A user's script that calls rpc_backend.run_local at its top level, without an ``if __name__
== "__main__":`` guard (run by tests/backend/test_launcher.py). Each rank runs the script's top
level as ``__mp_main__``, reaches the call again and must fail with multiprocessing's own
error, as a spawned process did, instead of starting a world of its own.

    python tests/backend/scripts/no_guard_job.py
"""

import os

from rpc_backend import run_local

print(f"TOP LEVEL {os.getpid()}", flush=True)
print("RESULT", run_local(os.getpid, 2, timeout=600, rpc_timeout=600), flush=True)  # SETUP_S
