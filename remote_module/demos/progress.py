"""Progress bars for the demos: tqdm's when it is installed and wanted, else one that shows
nothing (tqdm comes with the optional ``demo`` extra)."""

from __future__ import annotations

import threading
from typing import Any


class NoBar:
    """Stands in for a tqdm bar and shows nothing."""

    def update(self, n: int) -> None:
        pass

    def set_postfix(self, **kwargs: object) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, enabled: bool, **tqdm_kwargs: Any) -> Any:
    """``tqdm(total=total, **tqdm_kwargs)``, or a :class:`NoBar` when not ``enabled`` or tqdm
    is not installed.

    Example::

        bar = progress_bar(100, enabled=True, desc="training", unit="step")
        bar.update(1)
    """
    if not enabled:
        return NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return NoBar()
    if not hasattr(tqdm, "_lock"):
        # tqdm's default lock adds a multiprocessing lock (a named semaphore) for bars shared
        # with forked children; a demo's bars are each in their own rank, and a rank stopped by
        # Ctrl-C left that semaphore behind, for the resource tracker to warn about
        tqdm.set_lock(threading.RLock())
    return tqdm(total=total, **tqdm_kwargs)
