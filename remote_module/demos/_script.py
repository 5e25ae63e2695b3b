"""How a demo runs as a script (``python -m remote_module.demos.<name>``)."""

from __future__ import annotations

import sys
from typing import Any, Callable


def run_script(main: Callable[[], Any]) -> None:
    """Run ``main()``; on Ctrl-C (``run_local`` has stopped the ranks by then) say so in one
    line, with no traceback, and exit with status 130, as a shell reports SIGINT."""
    try:
        main()
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr, flush=True)
        sys.exit(130)
