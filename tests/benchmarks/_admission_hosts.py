"""The admission benchmark's id streams and its probes of a server's memory (importable on
every worker: functions called over RPC are module level, RPC pickles them by reference).

* :func:`spread`: stream positions to table ids by a bijection of ``[0, rows)``,
  ``i -> (A * i + B) mod rows`` (``A`` prime to ``rows``): distinct positions are distinct
  ids, so the hot set, the fresh ids and the drifting windows are disjoint by construction,
  and the ids are spread over the table as a real one's are;
* :func:`drift_positions`: a step's positions in the drifting stream, a window that slides by
  ``slide`` positions per step, drawn from uniformly (seeded per step: every variant sees the
  same stream);
* :func:`server_memory`, :func:`reset_peak`, :func:`trimmed_rss`: the calling process's
  resident set (``VmRSS``) and its peak (``VmHWM``), the peak's reset, and the resident set
  once the allocator gave back what it holds free (a diagnostic).
"""

from __future__ import annotations

import ctypes
import gc
import math

import torch

#: the multiplier of :func:`spread` (Knuth's multiplicative-hash constant, a prime)
A = 2_654_435_761
#: its offset
B = 12_345_678


def spread(positions: torch.Tensor, rows: int) -> torch.Tensor:
    """The table ids of stream ``positions`` (int64, each in ``[0, rows)``): a bijection."""
    if math.gcd(A, rows) != 1:
        raise ValueError(f"rows={rows} shares a factor with the multiplier {A}: not a bijection")
    if rows > (1 << 62) // A:
        raise ValueError(f"rows={rows} is too large for int64 products with {A}")
    return (positions.long() * A + B) % rows


def drift_positions(step: int, cfg: dict) -> torch.Tensor:
    """Step ``step``'s positions in the drifting stream: ``drift_batch`` draws (repeats allowed)
    from ``[step * drift_slide, step * drift_slide + drift_window)``."""
    gen = torch.Generator().manual_seed(cfg["seed"] * 1_000_003 + step)
    return step * cfg["drift_slide"] + torch.randint(0, cfg["drift_window"], (cfg["drift_batch"],), generator=gen)


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def server_memory() -> dict[str, int]:
    """``{"VmRSS": bytes, "VmHWM": bytes}`` of this process (Linux)."""
    return _status()


def reset_peak() -> bool:
    """Reset this process's peak resident set (``VmHWM``) to its current one (Linux's
    ``/proc/self/clear_refs``, value 5); False where that is refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def trimmed_rss() -> int | None:
    """This process's resident set after ``gc.collect()`` and glibc's ``malloc_trim(0)`` (the
    free memory its allocator held given back): what it still uses; None without glibc."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return None
    return _status()["VmRSS"]


def handler_threads() -> int:
    """``torch.get_num_threads()`` as an RPC handler thread of this process sees it."""
    return torch.get_num_threads()
