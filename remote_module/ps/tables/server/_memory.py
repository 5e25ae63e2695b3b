"""A table server's memory: glibc is told to map large allocations on their own and to hand
freed memory back to the system, so a long-lived server holding lazy tables grows by its rows,
not by the temporaries its lookups and pushes free."""

from __future__ import annotations

import ctypes
import itertools


def _glibc(name: str) -> object:
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):  # (not glibc)
        return None


_trim = _glibc("malloc_trim")
_mallopt = _glibc("mallopt")
#: glibc's mallopt parameter: allocations of at least this many bytes are mapped on their own
#: and unmapped when freed
_M_MMAP_THRESHOLD = -3
_fixed_threshold = False


def fix_mmap_threshold() -> None:
    """Once a lazy table lives here: allocations of 1 MiB or more are mapped on their own (and
    returned to the system when freed), always. glibc's default threshold moves up to each
    large block freed (up to 32 MiB), after which the blocks a lazy table grows into and drops
    stay in its heap, fragmented."""
    global _fixed_threshold
    if _mallopt is not None and not _fixed_threshold:
        _fixed_threshold = True
        _mallopt(_M_MMAP_THRESHOLD, 1 << 20)


#: lazy tables' steps on this server between two returns of freed memory to the system
TRIM_EVERY = 64
_lazy_steps = itertools.count(1)


def release_freed_memory() -> None:
    """Every ``TRIM_EVERY`` steps of lazy tables here, hand the memory malloc holds freed back
    to the system (glibc's ``malloc_trim``): a server's lookups and pushes free temporaries of
    every size, which glibc otherwise keeps per arena, so a long-lived server's memory would
    grow by far more than its rows."""
    if _trim is not None and next(_lazy_steps) % TRIM_EVERY == 0:
        _trim(0)
