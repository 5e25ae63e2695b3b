"""Progress bars for the demos: tqdm's when it is installed and wanted, else one that shows
nothing (tqdm comes with the optional ``demo`` extra)."""

from __future__ import annotations

import fcntl
import os
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


class TerminalLock:
    """tqdm's write lock for bars of several processes on one terminal (the ranks of a local
    world, which share no lock of their own): an exclusive ``flock`` on the file ``path``, held
    by one thread of one process at a time (reentrant within a thread, as tqdm's own lock), so
    one bar's cursor moves and frame are never interleaved with another's."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self._thread = threading.RLock()
        self._depth = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not self._thread.acquire(blocking, timeout):
            return False
        if self._depth == 0:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._thread.release()
                return False
        self._depth += 1
        return True

    def release(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._thread.release()

    def __enter__(self) -> "TerminalLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def progress_bar(total: int, enabled: bool, lock_path: str | None = None, **tqdm_kwargs: Any) -> Any:
    """``tqdm(total=total, **tqdm_kwargs)``, or a :class:`NoBar` when not ``enabled`` or tqdm
    is not installed. The bar is off (``bar.disable`` is True) when its stream is no terminal,
    unless ``disable=False`` is passed: frames drawn into a pipe or file pile up on one line.
    ``lock_path``: a file the processes sharing the terminal lock their bars' writes with
    (:class:`TerminalLock`).

    Example::

        bar = progress_bar(100, enabled=True, desc="training", unit="step")
        bar.update(1)
        shown = not bar_hidden(bar)  # else say how it goes some other way
    """
    if not enabled:
        return NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return NoBar()
    if lock_path is not None:
        tqdm.set_lock(TerminalLock(lock_path))
    elif not hasattr(tqdm, "_lock"):
        # tqdm's default lock adds a multiprocessing lock (a named semaphore) for bars shared
        # with forked children; a demo's bars are each in their own rank, and a rank stopped by
        # Ctrl-C left that semaphore behind, for the resource tracker to warn about
        tqdm.set_lock(threading.RLock())
    tqdm_kwargs.setdefault("disable", None)  # (tqdm's "off unless a terminal")
    return tqdm(total=total, **tqdm_kwargs)


def bar_hidden(bar: Any) -> bool:
    """Whether ``bar`` shows nothing (a :class:`NoBar`, or a tqdm bar that is off)."""
    return isinstance(bar, NoBar) or bool(getattr(bar, "disable", False))
