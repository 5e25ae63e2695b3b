"""A user's script run with rpc_backend.run_local whose own line triggers a DeprecationWarning
(run by tests/backend/test_launcher.py): the rank runs the script as ``__mp_main__``, and the
warning must show as it would for ``__main__``.

    python tests/backend/scripts/deprecation_job.py
"""

import warnings

from rpc_backend import run_local


def old_api() -> int:
    warnings.warn("old_api() is deprecated: call new_api()", DeprecationWarning, stacklevel=2)
    return 1


def main() -> int:
    return old_api()  # the user's line: the warning is attributed to this module


if __name__ == "__main__":
    print("RESULT", run_local(main, 1, timeout=600, rpc_timeout=600))  # tests/_deadlines.py: SETUP_S
