"""How long a local world lives: the launcher stops its ranks when it is told to stop
(SIGINT, SIGTERM), and a rank exits by itself when its launcher is gone.

Launcher side, :class:`StopSignals`: while ``run_local`` waits, SIGINT and SIGTERM are only
recorded; ``run_local`` polls :meth:`StopSignals.raise_if_received`, stops its ranks, and when
the block ends the previous handlers are back and the signal takes its usual effect
(SIGINT: ``KeyboardInterrupt``; SIGTERM: the process ends as SIGTERM ends it, or the
previous Python handler runs).

Rank side, :func:`exit_with_parent`: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` on Linux, and on
every platform a thread that notices ``os.getppid()`` change.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any, Callable

#: What ``run_local`` stops its ranks for.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_PR_SET_PDEATHSIG = 1


class StopSignalReceived(BaseException):
    """Raised inside ``run_local``'s wait when a stop signal arrived (a BaseException, like
    ``KeyboardInterrupt``, so ``except Exception`` in between does not swallow it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"received {signal.Signals(signum).name}: stopped the local world's ranks")
        self.signum = signum


class StopSignals:
    """Record SIGINT/SIGTERM while active; on exit restore the handlers, then let the first
    signal received take its usual effect.

    Only in the main thread (Python runs signal handlers there only); elsewhere it does
    nothing. A signal that is ignored (``SIG_IGN``) when the block starts stays ignored.

    Example::

        with StopSignals() as stop:
            while not done():
                stop.raise_if_received()     # StopSignalReceived: clean up in a finally
                time.sleep(0.2)
        # here a received SIGINT has become KeyboardInterrupt, a SIGTERM has ended the process
    """

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS) -> None:
        self.signals = signals
        self.received: tuple[int, FrameType | None] | None = None
        self._previous: dict[int, Any] = {}

    @property
    def active(self) -> bool:
        """True when this block installed handlers (it runs in the main thread)."""
        return bool(self._previous)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        for signum in self.signals:
            previous = signal.getsignal(signum)
            if previous is signal.SIG_IGN:
                continue
            self._previous[signum] = previous
            signal.signal(signum, self._record)
        return self

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = (signum, frame)

    def raise_if_received(self) -> None:
        """Raise :class:`StopSignalReceived` once a stop signal has arrived."""
        if self.received is not None:
            raise StopSignalReceived(self.received[0])

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        if self.received is None:
            return
        signum, frame = self.received
        handler = previous.get(signum)
        if callable(handler):
            try:
                handler(signum, frame)  # default_int_handler raises KeyboardInterrupt
            except BaseException as raised:
                if isinstance(exc, StopSignalReceived) or getattr(exc, "interrupted", False):
                    # that was only the way out of the block, or the same Ctrl-C seen by a rank
                    # before this process's handler ran
                    raised.__suppress_context__ = True
                raise
            return  # the handler chose to carry on: a StopSignalReceived goes on up
        # SIG_DFL (or a handler set outside Python): the signal's own default action
        os.kill(os.getpid(), signum)
        time.sleep(1.0)  # delivery to oneself is immediate; this is only a safety margin
        raise SystemExit(128 + signum)


def _set_parent_death_signal(signum: int) -> bool:
    """Ask Linux to send ``signum`` to this process when its parent exits; False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _orphaned() -> None:
    os.write(2, b"rpc_backend: this rank's launcher is gone; exiting\n")
    os._exit(1)


def exit_with_parent(
    parent_pid: int, *, interval: float = 0.5, on_orphaned: Callable[[], None] = _orphaned,
    use_prctl: bool = True,
) -> threading.Thread:
    """Make this process end when ``parent_pid`` (its launcher) is gone.

    On Linux the kernel kills it with SIGKILL the moment the parent exits
    (``PR_SET_PDEATHSIG``); everywhere, a daemon thread checks ``os.getppid()`` every
    ``interval`` seconds and calls ``on_orphaned`` (default: exit) once it differs from
    ``parent_pid`` (the orphan has been re-parented). Returns that thread.

    Example (first thing in a spawned rank; the launcher passes its ``os.getpid()``)::

        exit_with_parent(launcher_pid)
    """
    if use_prctl:
        _set_parent_death_signal(signal.SIGKILL)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval)
        on_orphaned()

    # the parent may have gone before prctl took effect: the thread's first check sees it
    thread = threading.Thread(target=watch, name="rpc-backend-parent-watchdog", daemon=True)
    thread.start()
    return thread
