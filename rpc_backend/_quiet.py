"""Two torch warnings that a user of ``rpc_backend`` can neither act on nor avoid, kept off
the console narrowly (matched by category and message; every other warning is untouched).

* gloo's "You are using a Backend ... as a ProcessGroup": ``torch.distributed.rpc.init_rpc``
  exchanges device maps with ``all_gather_object`` over a gloo backend object and warns once
  per rank. Ignored only around the ``init_rpc`` calls this package makes.
* TorchScript's "support for functional optimizers is deprecated": torch's own
  ``DistributedOptimizer`` scripts a functional optimizer on every worker holding parameters
  (for SGD, Adam and the other built-in optimizers) and warns there under
  ``warnings.simplefilter("always")``, which no warnings filter can override; torch offers no
  public way to keep that optimizer and skip the warning (the non-TorchScript path needs a
  custom optimizer class and applies stale gradients to parameters a step did not reach). The
  workers ``rpc_backend`` starts drop that one message when it is shown.
"""

from __future__ import annotations

import threading
import warnings
from contextlib import contextmanager
from typing import Any, Iterator

#: how gloo's backend-object warning starts (UserWarning or FutureWarning, by torch version)
BACKEND_AS_PROCESS_GROUP = "You are using a Backend"
#: how TorchScript's functional optimizer deprecation starts (a DeprecationWarning)
FUNCTIONAL_OPTIMIZER_DEPRECATION = "`TorchScript` support for functional optimizers is deprecated"

_hook_lock = threading.Lock()
_hook_installed = False


@contextmanager
def no_backend_as_process_group_warning() -> Iterator[None]:
    """Ignore gloo's "You are using a Backend ... as a ProcessGroup" inside the block only."""
    with warnings.catch_warnings():
        for category in (UserWarning, FutureWarning):
            warnings.filterwarnings("ignore", message=BACKEND_AS_PROCESS_GROUP, category=category)
        yield


def hide_functional_optimizer_deprecation() -> None:
    """From now on this process does not show TorchScript's functional optimizer deprecation
    (a ``DeprecationWarning`` starting with :data:`FUNCTIONAL_OPTIMIZER_DEPRECATION`); every
    other warning goes to the ``warnings.showwarning`` in place before. Idempotent."""
    global _hook_installed
    with _hook_lock:
        if _hook_installed:
            return
        previous = warnings.showwarning

        def show(message: Any, category: type[Warning], filename: str, lineno: int,
                 file: Any = None, line: str | None = None) -> None:
            if issubclass(category, DeprecationWarning) and str(message).startswith(FUNCTIONAL_OPTIMIZER_DEPRECATION):
                return
            previous(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        _hook_installed = True
