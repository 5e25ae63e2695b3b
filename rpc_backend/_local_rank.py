"""One rank of a ``run_local`` world, in its process forked by the zygote (``_zygote.py``).

It sets the environment torchrun would set, joins the RPC world and the heartbeats, runs the
caller's function, serves the other ranks until every one is done, and sends the launcher its
messages: "joined", "returned", then its result ("ok") or its failure ("error",
"interrupted"), and "lost" for each expendable peer its heartbeats lost.
"""

from __future__ import annotations

import os
import signal
import traceback
import warnings
from typing import Any, Callable

import torch.distributed.rpc as rpc

from rpc_backend._lifetime import exit_with_parent
from rpc_backend._quiet import hide_functional_optimizer_deprecation, no_backend_as_process_group_warning
from rpc_backend._sendable import UnpicklableResult, result_bytes
from rpc_backend.builds import world_checked
from rpc_backend.loopback import loopback_env
from rpc_backend.options import make_options
from rpc_backend.roles import RankPlacement
from rpc_backend.watch import WatchSettings, on_lost, start_watching
from rpc_backend.world import Worker, _set_current


def rank_entry(
    parent_pid: int,
    fn: Callable[..., Any],
    args: tuple,
    rank: int,
    layout: list[RankPlacement],
    store_port: int,
    option_kwargs: dict,
    shutdown_timeout: float | None,
    watching: WatchSettings | None,
    results: Any,
) -> None:
    """Run ``fn(*args)`` as rank ``rank`` of ``layout`` and report to the launcher over
    ``results``; ends the process with ``os._exit(1)`` when the rank fails."""
    exit_with_parent(parent_pid)  # a parent killed outright (SIGKILL) cannot stop its ranks
    signal.signal(signal.SIGINT, interrupt_once)
    hide_functional_optimizer_deprecation()
    # The user's script runs here as __mp_main__: show the DeprecationWarnings its own lines
    # trigger, as Python's default filters do for __main__ (a plain run or torchrun).
    warnings.filterwarnings("default", category=DeprecationWarning, module="__mp_main__")
    world_size = len(layout)
    me = layout[rank]
    _set_torchrun_env(rank, layout, store_port)
    try:
        init_method = f"tcp://{os.environ['MASTER_ADDR']}:{store_port}"
        options = make_options(init_method=init_method, worker_names=[p.name for p in layout], **option_kwargs)
        with no_backend_as_process_group_warning():
            rpc.init_rpc(me.name, rank=rank, world_size=world_size, rpc_backend_options=options)
        world_checked()  # every rank is forked from one process: one build (rpc_backend/builds.py)
        start_watching(me.name, layout, watching)
        if watching is not None and watching.expendable:
            _tell_launcher_of_losses(results, me.name)
        worker = _set_current(
            Worker(me.name, rank, world_size, rank, me.role, me.role_rank, me.role_size,
                   shutdown_timeout=shutdown_timeout, layout=list(layout))
        )
        results.put(("joined", rank, None))  # for the caller's progress messages
        value = fn(*args)
        results.put(("returned", rank, None))
    except BaseException as exc:
        _report_failure(results, rank, exc)
        # Skip the graceful barrier: the others may be waiting on this rank forever.
        os._exit(1)
    try:
        # Serve the other ranks until every one is done; the result goes out afterwards, so a
        # rank that could not finish its shutdown is reported as failed.
        worker.shutdown(graceful=True)
    except BaseException as exc:
        _report_failure(results, rank, exc)
        os._exit(1)
    try:
        payload = result_bytes(value)
    except UnpicklableResult as exc:
        _send(results, ("error", rank, str(exc)))
        os._exit(1)
    _send(results, ("ok", rank, payload))


def _set_torchrun_env(rank: int, layout: list[RankPlacement], store_port: int) -> None:
    """The variables torchrun gives a rank, on loopback, with the launcher's store."""
    me, world_size = layout[rank], len(layout)
    os.environ.update(loopback_env())
    os.environ.update(
        # the launcher's store, as torchrun's agent provides one (MASTER_ADDR is 127.0.0.1)
        MASTER_PORT=str(store_port),
        TORCHELASTIC_USE_AGENT_STORE="True",
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        ROLE_NAME=me.role,
        ROLE_RANK=str(me.role_rank),
        ROLE_WORLD_SIZE=str(me.role_size),
    )


def _tell_launcher_of_losses(results: Any, me: str) -> None:
    """Send the launcher each expendable peer this rank's heartbeats count lost: a frozen rank
    never exits by itself, and the launcher waits for every process (it kills that one)."""

    def tell(lost: Any) -> None:
        try:
            results.put(("lost", lost.rank, f"not heard from for {lost.silent_s:.1f} s (noticed by {me})"))
        except (OSError, ValueError):  # this rank is past its report: the launcher has its result
            pass

    on_lost(tell)


def interrupt_once(signum: int, frame: Any) -> None:
    """A rank's SIGINT handler: the first raises ``KeyboardInterrupt`` as Python's own does;
    later ones are ignored. The same Ctrl-C has reached the launcher, which stops every rank,
    so a second one (``timeout`` and some shells send it again to the whole group) would only
    interrupt the rank's report of the first, printing chained tracebacks."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _report_failure(results: Any, rank: int, exc: BaseException) -> None:
    """Send the launcher ``exc``'s traceback. A rank interrupted (``KeyboardInterrupt``) then
    waits, its connections open, until the launcher stops the world: the launcher then stops
    the ranks together (or the same Ctrl-C has reached them all), whereas a rank that
    exited alone made its peers' TensorPipe agents warn on the console that it was gone."""
    status = failure_status(exc)
    _send(results, (status, rank, traceback.format_exc()))
    if status == "interrupted":
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C: nothing more to say
        while True:
            signal.pause()  # SIGTERM (the launcher's _stop) ends the process


def failure_status(exc: BaseException) -> str:
    """How a rank reports ``exc``: "interrupted" for a ``KeyboardInterrupt`` (the rank got
    SIGINT, as every process of a terminal's foreground group does on Ctrl-C), else "error"."""
    return "interrupted" if isinstance(exc, KeyboardInterrupt) else "error"


def _send(results: Any, item: tuple) -> None:
    """Put ``item`` and wait until it is flushed: the process may ``os._exit`` right after."""
    results.put(item)
    results.close()
    results.join_thread()
