"""How a rank watches its peers (``rpc_backend/watch.py``): the heartbeat and ``lost_after``
seconds, from the arguments or the environment, and the expendable roles, checked once."""

from __future__ import annotations

import math
import os
from typing import Any, Iterable, Mapping, NamedTuple

from rpc_backend.options import positive_seconds

#: Seconds between heartbeats, unless ``heartbeat=`` or :data:`HEARTBEAT_ENV` says otherwise.
DEFAULT_HEARTBEAT_S = 1.0
#: Seconds of silence after which a peer is lost, unless ``lost_after=`` or :data:`LOST_AFTER_ENV` says otherwise.
DEFAULT_LOST_AFTER_S = 10.0
HEARTBEAT_ENV = "RPC_BACKEND_HEARTBEAT_S"
LOST_AFTER_ENV = "RPC_BACKEND_LOST_AFTER_S"
#: What :data:`LOST_AFTER_ENV` may be set to for "never lost" (watching off).
OFF_WORDS = ("off", "inf", "none")
#: The shortest heartbeat accepted (seconds): shorter ones flood every peer with messages.
MIN_HEARTBEAT_S = 0.05


class WatchSettings(NamedTuple):
    """How a rank watches its peers (:func:`watch_settings` resolves and checks them)."""

    heartbeat: float
    lost_after: float
    expendable: frozenset[str]


def _seconds_from(value: Any, what: str, variable: str, env: Mapping[str, str], default: float) -> float:
    if value is None:
        raw = env.get(variable, "").strip()
        if not raw:
            return default
        if raw.lower() in OFF_WORDS:
            return math.inf
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{variable}={raw!r} is not a number of seconds; set it to e.g. 10, or to 'off'") from None
        what = variable
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == math.inf:
        return math.inf
    return positive_seconds(value, what)


def watch_settings(
    heartbeat: float | None = None,
    lost_after: float | None = None,
    expendable: Iterable[str] = (),
    roles: Iterable[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> WatchSettings | None:
    """The checked settings, or ``None`` when watching is off.

    ``heartbeat`` and ``lost_after`` are seconds; ``None`` takes :data:`HEARTBEAT_ENV` /
    :data:`LOST_AFTER_ENV` from ``env`` (default ``os.environ``), else the defaults (1 s, 10 s).
    ``lost_after`` of ``math.inf`` (the variable: ``off``) turns watching off. ``lost_after``
    must be at least twice ``heartbeat``. ``expendable`` names roles (checked against
    ``roles`` when given).

    Example::

        >>> watch_settings(heartbeat=0.5, lost_after=5, expendable=("replica",), roles=("ps", "replica"), env={})
        WatchSettings(heartbeat=0.5, lost_after=5.0, expendable=frozenset({'replica'}))
    """
    env = os.environ if env is None else env
    if isinstance(expendable, str):
        raise TypeError(f"expendable takes role names, e.g. expendable=({expendable!r},), got the str {expendable!r}")
    expendable = frozenset(expendable)
    for role in expendable:
        if not isinstance(role, str):
            raise TypeError(f"expendable takes role names (str), got {role!r}")
    if roles is not None:
        known = list(dict.fromkeys(roles))
        unknown = sorted(expendable - set(known))
        if unknown:
            raise ValueError(f"expendable names {', '.join(map(repr, unknown))}, which is not a role of this job "
                             f"(roles: {', '.join(map(repr, known))})")
    # name each setting where the user gave it: the argument, or the environment variable
    hb_what = "heartbeat" if heartbeat is not None or not env.get(HEARTBEAT_ENV, "").strip() else HEARTBEAT_ENV
    after_what = ("lost_after" if lost_after is not None or not env.get(LOST_AFTER_ENV, "").strip()
                  else LOST_AFTER_ENV)
    hb = _seconds_from(heartbeat, "heartbeat", HEARTBEAT_ENV, env, DEFAULT_HEARTBEAT_S)
    if hb == math.inf:
        raise ValueError(f"{hb_what} must be a finite number of seconds; to stop watching, set lost_after=math.inf "
                         f"or {LOST_AFTER_ENV}=off")
    if hb < MIN_HEARTBEAT_S:
        raise ValueError(f"{hb_what} ({hb} s) is below {MIN_HEARTBEAT_S} s: every rank would send each peer "
                         f"{1 / hb:.0f} heartbeats a second")
    after = _seconds_from(lost_after, "lost_after", LOST_AFTER_ENV, env, DEFAULT_LOST_AFTER_S)
    if after == math.inf:
        return None
    if after < 2 * hb:
        raise ValueError(f"{after_what} ({after} s) must be at least twice {hb_what} ({hb} s): a peer is lost only "
                         f"after missing several heartbeats")
    return WatchSettings(hb, after, expendable)
