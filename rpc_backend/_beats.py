"""What a heartbeat carries (:class:`Beat`: who, where, its phase and status line) and what
a lost peer is named with (:class:`LostWorker`, :func:`describe_lost`, :class:`WorkerLost`),
plus the status lines that layers above put in this rank's heartbeats (:func:`add_status`).
See ``rpc_backend/watch.py`` for how heartbeats find a lost peer."""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, NamedTuple, Sequence

#: Longest status line a heartbeat carries.
MAX_STATUS_CHARS = 200

RUNNING = "running"
LEAVING = "leaving"


class Origin(NamedTuple):
    """Where a worker runs: what a lost one is named by."""

    hostname: str
    address: str
    #: torchrun's ``GROUP_RANK`` (its machine's rank in the job), "" when not under torchrun
    group_rank: str
    pid: int

    def machine(self) -> str:
        """``"machine1 (10.42.0.2, torchrun group rank 1)"``."""
        details = [d for d in (self.address, self.group_rank and f"torchrun group rank {self.group_rank}") if d]
        return f"{self.hostname} ({', '.join(details)})" if details else self.hostname


class Beat(NamedTuple):
    """What a heartbeat carries, each way (the answer is the receiver's own)."""

    name: str
    #: :data:`RUNNING`, or :data:`LEAVING` once the sender's graceful shutdown has begun
    phase: str
    #: what layers above report (:func:`add_status`), e.g. "step 41 of PSModel 'mlp'"; "" if nothing
    status: str
    origin: Origin
    #: set in the last heartbeats of a rank that lost a peer and ends: the receivers end too
    lost: tuple = ()


class LostWorker(NamedTuple):
    """A peer not heard from for ``lost_after`` seconds (or, named with one, for some seconds)."""

    name: str
    rank: int
    role: str
    #: where it ran, from its last heartbeat (None: never heard from)
    origin: Origin | None
    #: its last status line ("" if none)
    status: str
    #: its last phase heard (:data:`RUNNING` when never heard from)
    phase: str
    #: seconds since it was last heard from, when it was named
    silent_s: float
    expendable: bool

    def describe(self) -> str:
        """``"trainer1 (rank 2, pid 4242, at step 41 of PSModel 'mlp', not heard from for 10.2 s)"``."""
        parts = [f"rank {self.rank}"]
        if self.origin is not None:
            parts.append(f"pid {self.origin.pid}")
        if self.status:
            parts.append(f"at {self.status}")
        if self.phase == LEAVING:
            parts.append("in its graceful rpc.shutdown()")  # (where a server serves: not leaving yet)
        parts.append(f"not heard from for {self.silent_s:.1f} s")
        return f"{self.name} ({', '.join(parts)})"


def describe_lost(lost: Sequence[LostWorker]) -> str:
    """The lost workers grouped by machine, e.g. ``"trainer1 (...) and trainer2 (...) on
    machine1 (10.42.0.2, torchrun group rank 1)"``; machines in the order of their first
    worker's rank."""
    groups: dict[str, list[LostWorker]] = {}
    for worker in sorted(lost, key=lambda w: w.rank):
        where = worker.origin.machine() if worker.origin is not None else "a machine never heard from"
        groups.setdefault(where, []).append(worker)
    parts = []
    for where, workers in groups.items():
        named = [w.describe() for w in workers]
        listed = named[0] if len(named) == 1 else f"{', '.join(named[:-1])} and {named[-1]}"
        parts.append(f"{listed} on {where}")
    return "; ".join(parts)



class WorkerLost(BaseException):
    """Raised in a rank's main thread when a peer of a role that is not expendable is lost.

    A ``BaseException`` (as ``KeyboardInterrupt``), so that ``except Exception`` in a training
    loop does not swallow it; ``lost`` lists the :class:`LostWorker` records, the message names
    them by machine. The rank exits anyway :data:`~rpc_backend.watch.END_GRACE_S` seconds after
    it is raised.
    """

    def __init__(self, message: str, lost: Sequence[LostWorker]) -> None:
        super().__init__(message)
        self.lost = list(lost)

    def __reduce__(self) -> tuple:
        # pickled (and copied) by its constructor's arguments: BaseException's own reduce
        # would call it with the message alone
        return type(self), (self.args[0], self.lost), self.__dict__



# ---- status lines from layers above --------------------------------------------------------

_status_lock = threading.Lock()
_statuses: list[tuple[Callable[..., str | None], Any]] = []  # (describe, weakref to owner or None)


def add_status(describe: Callable[..., str | None], owner: Any = None) -> Callable[[], None]:
    """Report ``describe()`` in this rank's heartbeats (``describe(owner)`` while ``owner``
    lives, held weakly, when an owner is given); a peer that loses this rank names it with
    that line. Returns a callable that removes it. ``describe`` runs on the heartbeat thread
    every heartbeat: keep it cheap; ``None`` or an exception leaves it out.

    Example (``remote_module.ps`` reports each model's step this way)::

        add_status(lambda model: f"step {model.steps} of {model.name!r}", owner=model)
        add_status(lambda: f"epoch {epoch[0]}")
    """
    entry = (describe, None if owner is None else weakref.ref(owner))
    with _status_lock:
        # (owners gone are dropped here too: a process may make many models and never watch)
        _statuses[:] = [e for e in _statuses if e[1] is None or e[1]() is not None]
        _statuses.append(entry)

    def remove() -> None:
        with _status_lock:
            if entry in _statuses:
                _statuses.remove(entry)

    return remove


def current_status() -> str:
    """This rank's status line: every :func:`add_status` line, joined (at most
    :data:`MAX_STATUS_CHARS` characters)."""
    lines = []
    with _status_lock:
        entries = list(_statuses)
    dead = []
    for describe, ref in entries:
        try:
            if ref is None:
                line = describe()
            else:
                owner = ref()
                if owner is None:
                    dead.append((describe, ref))
                    continue
                line = describe(owner)
        except Exception:
            continue
        if line:
            lines.append(str(line))
    if dead:
        with _status_lock:
            _statuses[:] = [e for e in _statuses if e not in dead]
    text = "; ".join(lines)
    return text if len(text) <= MAX_STATUS_CHARS else text[: MAX_STATUS_CHARS - 3] + "..."
