"""``make demo``: a small DLRM-style click model trained on parameter servers.

Three sparse features (a user, an ad and a site id per click, three ids each) look up
``ShardedEmbeddingBag`` tables of 1,000,000, 100,000 and 10,000 rows sliced over the parameter
servers, grouped in a ``ShardedEmbeddingBagCollection``: a step's lookups of all three tables
travel in one message per server, and so do their pushes; only the rows a batch touches travel,
both ways. The dense part (bottom and top MLPs)
trains on every trainer under ``DistributedDataParallel`` (gloo, among the trainers only).
Clicks are synthetic, drawn from a hidden ground truth: a weight for every table row plus a
dense weight vector. Ids follow a Zipf-like popularity curve (a few ids are frequent, most are
rare), so the tables can learn the frequent rows within a short run, and most of what there is
to learn is in the tables: the summary shows the AUC the truth itself reaches and the AUC of its
dense part alone, which the model can only beat by training its tables.

Run it on a local world (every rank a process on this machine, loopback only)::

    python -m remote_module.demos.dlrm [--mode async|sync|half_async|geo] [--servers 2]
                                       [--trainers 2] [--steps 150]
                                       [--stream] [--admit-after K] [--evict-after-steps N]
                                       [--checkpoint DIR --every N]

or under torchrun, one rank per process, the first ``--servers`` ranks serving the tables::

    torchrun --standalone --nproc-per-node=4 -m remote_module.demos.dlrm --servers 2

trainer0 tells the setup (the same on every trainer) once; then each trainer shows a progress
bar (when tqdm is installed and stderr is a terminal; else a line every few seconds); at the end
one summary table is printed (by trainer0 under torchrun) and, when matplotlib is installed, a
PNG of the loss and AUC curves is written, titled with the run. ``--json PATH`` also writes
every trainer's figures there, each step's loss among them, at full precision (to compare runs).

The rows' lifetime on the servers: ``--stream`` makes the ids drift (each table keeps a popular
head of ids all run long; its other ids come from a window of the id space that slides with the
step, so new ids appear, popular at first, fade, and stop); ``--admit-after K`` stores an id's row
only once the id was looked up in K of its table's steps; ``--evict-after-steps N`` drops a row
not stepped in N of its table's steps. With any of them the tables are ``init="lazy"`` (rows
created as they are admitted), trainer0 samples ``table_stats()`` a few dozen times over the run,
and the summary and PNG show the rows each server holds over time.

Checkpoints: ``--checkpoint DIR --every N`` saves the job every N steps into DIR (the tables,
each server writing its own shards into ``DIR/step-XXXXXXXX/ps/`` in the background while
training goes on; each trainer's dense model, optimizer, batch generator and RNG states; the
newest 2 kept, ``remote_module.ps.Checkpointer``; ``--full-every K``: the tables whole every K-th
checkpoint, only their changed rows in the others), and a run started again with the same DIR
(after a kill, a torchrun restart, or a run that ended) resumes from the newest complete
checkpoint, saying ``resumed from step k``, and trains up to ``--steps`` (the summary covers the
steps it trained, and ends with the saves: how many, their size, the seconds trainer0's training
waited per save and the seconds the servers took to write the newest one).

The network: the summary ends with the bytes per training step between trainers and servers,
each way, measured on what each trainer's calls sent and were answered (``rpc_backend.Traffic``:
the RPC payload, without TensorPipe's framing or TCP/IP headers), and the rate they make at each
trainer's steps/s: what the network between them must carry (tutorials/performance.md compares
them with a link's counters).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed.rpc as rpc
from torch import nn

from remote_module.demos._dlrm_figures import Curves, HeldOut, RowsHeld, figures, server_traffic
from remote_module.demos._dlrm_model import (
    ADMIT_SKETCH_BYTES,
    BAG,
    BATCH,
    DENSE,
    DIM,
    EVAL,
    GEO_PUSH_EVERY,
    MODES,
    PLAIN_PROGRESS_EVERY,
    STATS_SAMPLES,
    STREAM_DRIFT,
    STREAM_HEAD,
    STREAM_WINDOW,
    TABLES,
    WINDOW,
    ZIPF,
    Batch,
    Dense,
    Truth,
    auc,
    plural,
    rows_lifetime,
)
from remote_module.demos._dlrm_summary import NETWORK_COUNTED, plot, run_title, summary
from remote_module.demos._script import run_script
from remote_module.demos.progress import bar_hidden, progress_bar
from rpc_backend import (
    DEFAULT_TRANSPORT,
    TRANSPORTS,
    Traffic,
    Worker,
    current_worker,
    init_from_env,
    init_role_process_group,
    read_env,
    run_local,
)

__all__ = [  # (the model and its clicks, the figures, the summary: _dlrm_model, _dlrm_figures, _dlrm_summary)
    "TABLES", "DIM", "DENSE", "BAG", "BATCH", "ZIPF", "EVAL", "PLAIN_PROGRESS_EVERY", "WINDOW", "MODES",
    "GEO_PUSH_EVERY", "STREAM_HEAD", "STREAM_WINDOW", "STREAM_DRIFT", "STATS_SAMPLES", "ADMIT_SKETCH_BYTES",
    "NETWORK_COUNTED", "Batch", "Truth", "Dense", "auc", "train", "rows_lifetime", "RowsHeld", "say", "plural",
    "still", "summary", "plot", "run_title", "parse_args", "main",
]


def train(args: argparse.Namespace) -> dict[str, Any]:
    """One trainer's run: train ``args.steps`` steps, then score held-out clicks; the figures
    the summary prints (see :func:`summary`) plus the loss and progressive-AUC curves."""
    from remote_module.ps import Checkpointer, ShardedEmbeddingBagCollection, prefetching

    me = current_worker()
    lead = me.role_rank == 0  # the setup is the same on every trainer: trainer0 tells it, once
    servers = _join_trainers(me, lead)
    dense, opt, truth = _dense_part(lead)
    lifetime = rows_lifetime(args)
    tables = _make_tables(args, me, servers, lifetime, lead)
    # the tables looked up together (one message per server) and stepped together
    ebc = ShardedEmbeddingBagCollection(tables)
    gen = torch.Generator().manual_seed(100 + me.role_rank)
    stream = getattr(args, "stream", False)
    source = _Batches(truth, gen, stream)
    first = 0  # the steps done before this run (a checkpoint's)
    ckpt = None
    if getattr(args, "checkpoint", ""):
        ckpt = Checkpointer(args.checkpoint, every_steps=args.every, keep=2, ps={"tables": ebc},
                            local={"dense": dense, "opt": opt, "batches": source},
                            full_every=getattr(args, "full_every", None) or 1)
        first = ckpt.resume()
        if first >= args.steps:
            raise SystemExit(f"{me.name}: the checkpoint in {args.checkpoint} holds {first} steps, --steps is "
                             f"{args.steps}: nothing is left to train (pass more --steps)")
        if lead and first:
            say(f"resumed from step {first} (the newest checkpoint in {args.checkpoint})")
    if lead:
        say(f"training {args.steps - first} steps of {BATCH} clicks per trainer ({args.mode} mode)")
    _trainers_barrier()  # every setup line is out before the bars draw (they share the terminal)
    lines = _StepLines(args, me)
    curves = Curves(lifetime)
    # trainer0 samples the servers' rows every `every` steps (none in a plain run)
    held = RowsHeld(tables.values(), args.steps) if lifetime and me.role_rank == 0 else None
    # the bytes this trainer's calls carry, each way, from here until its last push landed
    cpu = _cpu_now(servers if lead else [])  # (this process's, and trainer0 reads the servers': not counted below)
    with Traffic() as traffic:
        start = time.perf_counter()
        # batch k + 1's lookups are planned during batch k and sent with its ebc.step(): one message
        # per server per step, answered once the servers applied the step (the same results)
        # (--overlap: async modes, lookups one step further ahead: a read misses this trainer's last push)
        batches = prefetching(source.batches(first, args.steps), ebc, features=lambda b: dict(zip(TABLES, b.ids)),
                              overlap=getattr(args, "overlap", False))
        for step, batch in enumerate(batches, first + 1):
            out = curves.timed_lookup(ebc, batch)
            if held is not None and (step - 1) % held.every == 0 and step > 1:
                held.sample(step - 1)  # (the last step landed: the forward waited for its answer)
            curves.note_ids(batch)
            scores, loss = _train_step(dense, opt, ebc, batch, out)
            scored = curves.record(step, args.steps, scores, loss, batch)
            lines.step(step, curves, scored)
            if ckpt is not None:
                source.done = step
                ckpt.step()  # every --every steps: a checkpoint
        ebc.flush()  # the last step's pushes landed
        if ckpt is not None:
            ckpt.close()
    cpu = {name: seconds - cpu[name] for name, seconds in _cpu_now(servers if lead else []).items()}
    if held is not None:
        held.sample(args.steps)
    elapsed = time.perf_counter() - start - (held.seconds if held is not None else 0.0)
    _close_in_order(lines.bar, me)
    say(f"{me.name}: {args.steps} steps done; scoring {EVAL} held-out clicks")
    held_out = HeldOut.score(truth, ebc, dense, args.steps if stream else None)
    trained = argparse.Namespace(**{**vars(args), "steps": args.steps - first})  # (the figures: this run's steps)
    mine = figures(me, trained, tables, ebc, server_traffic(traffic, servers), curves, held_out, elapsed, held)
    # CPU seconds of this process over its training loop (trainer0: the servers' too, over its loop)
    mine["cpu_s"] = {(me.name if name == "" else name): seconds for name, seconds in cpu.items()}
    if ckpt is not None:
        mine["checkpoints"] = {"resumed_from": first, **ckpt.stats()}
    return mine


def _cpu_now(servers: list[str]) -> dict[str, float]:
    """CPU seconds so far (every thread, user and system) of this process (``""``) and of the
    ``servers`` (asked over RPC)."""
    return {"": time.process_time(), **{server: rpc.rpc_sync(server, time.process_time) for server in servers}}


class _Batches:
    """A trainer's batches by step, and their state for a checkpoint: the generator's state
    before the batch of the first step not trained (``done``: the steps trained; the prefetch
    draws a batch ahead, so the generator itself is past it)."""

    def __init__(self, truth: Truth, gen: torch.Generator, stream: bool) -> None:
        self.truth, self.gen, self.stream = truth, gen, stream
        self.done = 0
        self._before: dict[int, torch.Tensor] = {}  # step index -> the generator's state before its batch

    def batches(self, first: int, last: int) -> Iterator[Batch]:
        for k in range(first, last):
            self._before = {s: state for s, state in self._before.items() if s >= self.done}
            self._before[k] = self.gen.get_state()
            yield self.truth.batch(self.gen, step=k if self.stream else None)

    def state_dict(self) -> dict[str, Any]:
        return {"done": self.done, "gen": self._before.get(self.done, self.gen.get_state())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.done = state["done"]
        self.gen.set_state(state["gen"])


def _join_trainers(me: Worker, lead: bool) -> list[str]:
    """Form the trainers' DDP group; the parameter servers' names."""
    if lead:
        say(f"forming the trainers' DDP group ({plural(me.role_size, 'trainer')})")
    init_role_process_group(me)
    return me.workers("ps")


def _dense_part(lead: bool) -> tuple[nn.Module, torch.optim.Optimizer, Truth]:
    """The dense model under DDP, its optimizer, and the hidden truth the clicks come from."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)  # the same dense initialisation on every trainer (DDP checks it anyway)
    # (the process's first torch.optim optimizer imports torch._dynamo, a few seconds once per
    # process: said here, not taken for the first table's creation, whose ps_optimizer makes one)
    with still("building the dense model and its optimizer (torch.optim's first use imports torch._dynamo)",
               quiet=not lead):
        dense = DDP(Dense())
        opt = torch.optim.Adam(dense.parameters(), lr=0.003)
        truth = Truth()
    return dense, opt, truth


def _make_tables(args: argparse.Namespace, me: Worker, servers: list[str], lifetime: bool,
                 lead: bool) -> dict[str, Any]:
    """The ``ShardedEmbeddingBag`` tables, by name, sliced over ``servers``; lazy ones when
    the run watches its rows' lifetime."""
    from remote_module.ps import ShardedEmbeddingBag

    # geo: a trainer pushes every cached row's delta each geo_push_every steps
    # --stream, --admit-after, --evict-after-steps: lazy tables (a row stored once admitted)
    kwargs: dict[str, Any] = {}
    if lifetime:
        kwargs = {"init": "lazy", "admit_after": args.admit_after, "evict_after_steps": args.evict_after_steps}
        if args.admit_after > 1:
            kwargs["admit_sketch_bytes"] = ADMIT_SKETCH_BYTES
    tables = {}
    for t, (name, rows) in enumerate(TABLES.items()):
        lazy = " (lazy)" if lifetime else ""
        with still(f"creating table {name} ({rows:,} rows x {DIM}){lazy} on {plural(len(servers), 'server')}",
                   quiet=not lead):
            tables[name] = ShardedEmbeddingBag(
                rows, DIM, servers, name=f"dlrm.{name}", mode="mean", ps_mode=args.mode, num_trainers=me.role_size,
                optimizer=(torch.optim.Adagrad, {"lr": 0.3}), min_block_size=4096, geo_push_every=GEO_PUSH_EVERY,
                seed=t,
                **kwargs)
    return tables


def _train_step(dense: nn.Module, opt: torch.optim.Optimizer, ebc: Any, batch: Batch,
                out: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One training step on ``batch`` whose pooled lookups are ``out``: the dense part's
    step, then every table's (its touched rows, with the next batch's lookups, one message
    per server); the batch's scores and loss."""
    scores = dense(batch.dense, [out[name] for name in TABLES])
    loss = nn.functional.binary_cross_entropy_with_logits(scores, batch.clicks)
    opt.zero_grad()
    loss.backward()
    opt.step()
    ebc.step()
    return scores, loss


class _StepLines:
    """A trainer's progress: its bar, or without a bar on screen (no terminal,
    --no-progress, no tqdm) a line every few seconds."""

    def __init__(self, args: argparse.Namespace, me: Worker) -> None:
        self.bar = _progress(args.steps, me, args.progress, getattr(args, "terminal_lock", None))
        self.plain_every = PLAIN_PROGRESS_EVERY if bar_hidden(self.bar) else None
        self.last_line = time.monotonic()
        self.name, self.steps = me.name, args.steps

    def step(self, step: int, curves: Curves, scored: bool) -> None:
        """Step ``step`` is done (``scored``: its progressive AUC is new)."""
        if scored:
            self.bar.set_postfix(loss=f"{curves.losses[-1]:.3f}", train_auc=f"{curves.auc_curve[-1][1]:.3f}",
                                 refresh=False)
        self.bar.update(1)
        if self.plain_every is not None and time.monotonic() - self.last_line >= self.plain_every:
            self.last_line = time.monotonic()
            last_auc = curves.auc_curve[-1][1] if curves.auc_curve else None
            auc_text = f", training AUC (last {WINDOW} batches) {last_auc:.3f}" if last_auc is not None else ""
            say(f"{self.name}: step {step}/{self.steps}, loss {curves.losses[-1]:.3f}{auc_text}")





def _progress(total: int, me: Worker, enabled: bool, lock_path: str | None = None) -> Any:
    """A tqdm bar on this trainer's own line: the trainers on one machine share its terminal,
    so the line is this trainer's index among them, and their bars write under one lock
    (``lock_path``'s, see :class:`~remote_module.demos.progress.TerminalLock`). Off (or no
    tqdm) when stderr is no terminal."""
    first_here = me.rank - me.local_rank  # launchers give a machine's ranks consecutive numbers
    line = sum(1 for p in me.layout[first_here:me.rank] if p.role == me.role)
    return progress_bar(total, enabled, lock_path=lock_path, desc=me.name, position=line, unit="step", leave=True,
                        dynamic_ncols=True)


def _trainers_barrier() -> None:
    """Wait for every trainer (over the trainers' process group)."""
    import torch.distributed as dist

    dist.barrier()


def _close_in_order(bar: Any, me: Worker) -> None:
    """Close the trainers' bars one by one in rank order: tqdm writes a closing bar on the line
    the terminal's cursor is on (the first bar's), then a newline, so closing the top bar first
    leaves the bars in order."""
    import torch.distributed as dist

    for rank in range(me.role_size):
        if rank == me.role_rank:
            bar.close()
        dist.barrier()  # over the trainers' process group


def _rank(args: argparse.Namespace) -> dict[str, Any] | None:
    # Ranks sharing a machine's cores: more intra-op threads than cores per rank only spin
    # (OpenMP waits busily after each parallel op) and slow down the other ranks' RPCs.
    torch.set_num_threads(args.threads)
    me = current_worker()
    if me.role == "ps":
        return None  # serves the tables' blocks; under torchrun the servers print nothing
    result = train(args)
    say(f"{me.name}: finished; waiting for every rank to finish")
    return result


def say(text: str) -> None:
    """One progress line on stdout, right away, in one write (ranks share the terminal, and
    ``print`` writes the line's end separately)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


@contextmanager
def still(text: str, every: float = PLAIN_PROGRESS_EVERY, quiet: bool = False) -> Iterator[None]:
    """Say ``text`` now, then ``text (still, N s)`` every ``every`` seconds until the block ends
    (``quiet``: say nothing)."""
    if quiet:
        yield
        return
    say(text)
    done = threading.Event()
    start = time.monotonic()

    def remind() -> None:
        while not done.wait(every):
            say(f"{text} (still, {time.monotonic() - start:.0f} s)")

    thread = threading.Thread(target=remind, name="dlrm-demo-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked (argparse exits with a message naming the bad option)."""
    parser = _parser()
    args = parser.parse_args(argv)
    _check_combinations(parser, args)
    _size_the_world(parser, args)
    return args


def _parser() -> argparse.ArgumentParser:
    """The demo's options, with their help."""
    parser = argparse.ArgumentParser(prog="python -m remote_module.demos.dlrm",
                                     description="Train a small DLRM-style click model on parameter servers.")
    parser.add_argument("--mode", choices=MODES, default="async", help="parameter-server mode (default: async)")
    parser.add_argument("--servers", type=_at_least_one, default=2, help="parameter servers (default: 2)")
    parser.add_argument("--trainers", type=_at_least_one, default=None,
                        help="trainers (default: 2; under torchrun: the other ranks, WORLD_SIZE - servers)")
    parser.add_argument("--steps", type=_at_least_one, default=150, help="training steps per trainer (default: 150)")
    parser.add_argument("--threads", type=_at_least_one, default=None,
                        help="torch threads per rank (default: this machine's cores / its ranks, at least 1)")
    parser.add_argument("--transport", choices=TRANSPORTS, default=DEFAULT_TRANSPORT,
                        help="TensorPipe transport: uv sleeps when idle, shm (torch's defaults) busy-polls "
                             "(default: %(default)s)")
    parser.add_argument("--overlap", action="store_true",
                        help="async and half_async: send each batch's lookups one step earlier, so they overlap the "
                             "previous batch's compute (a read then misses this trainer's last push)")
    parser.add_argument("--stream", action="store_true",
                        help=f"ids drift over time: each table's {STREAM_HEAD} most popular ids stay, the others come "
                             f"from a window of {STREAM_WINDOW:,} ids sliding {STREAM_DRIFT} ids a step (new ids "
                             "appear, old ones stop); the held-out clicks are drawn where the stream ends")
    parser.add_argument("--admit-after", type=_at_least_one, default=1, metavar="K",
                        help="store a row only once its id was looked up in K of its table's steps (default: 1, "
                             "the first)")
    parser.add_argument("--evict-after-steps", type=_at_least_one, default=None, metavar="N",
                        help="drop a row not stepped in N of its table's steps (a table's step: sync, one per "
                             "training step; async, one per trainer's push; half_async, one per merge; default: never)")
    parser.add_argument("--checkpoint", default="", metavar="DIR",
                        help="save the job into DIR every --every steps, and resume from the newest checkpoint there "
                             "(a directory every trainer and server sees)")
    parser.add_argument("--every", type=_at_least_one, default=None, metavar="N",
                        help="with --checkpoint: the steps between checkpoints (default: 100)")
    parser.add_argument("--full-every", type=_at_least_one, default=None, metavar="K",
                        help="with --checkpoint: save the tables whole every K-th checkpoint, and between those only "
                             "the rows changed since the checkpoint before (incremental saves; default: 1, all whole)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    parser.add_argument("--plot", default="dlrm-demo.png", metavar="PNG",
                        help="where to write the loss/AUC curves, and rows held (needs matplotlib; '' for none; "
                             "default: %(default)s)")
    parser.add_argument("--json", default="", metavar="PATH",
                        help="also write every trainer's figures to PATH as JSON: the summary's, each step's loss "
                             "and the training AUC curve, at full precision (under torchrun: by trainer0)")
    parser.epilog = ("With --stream, --admit-after above 1 or --evict-after-steps the tables are lazy "
                     "(init='lazy': a row is created when admitted, not up front), and trainer0 samples "
                     f"table_stats() about {STATS_SAMPLES} times: the summary and PNG show the rows each server "
                     "holds over the run.")
    return parser


def _check_combinations(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse the options that do not go together (argparse exits naming them)."""
    if args.mode == "geo" and (args.admit_after > 1 or args.evict_after_steps is not None):
        parser.error("--admit-after and --evict-after-steps are for --mode sync, async or half_async (geo trainers "
                     "train their rows locally and push deltas)")
    from remote_module.ps import MAX_ADMIT_AFTER

    if args.admit_after > MAX_ADMIT_AFTER:
        parser.error(f"argument --admit-after: must be at most {MAX_ADMIT_AFTER}, got {args.admit_after}")
    if args.every is not None and not args.checkpoint:
        parser.error("--every is the steps between checkpoints: pass --checkpoint DIR too")
    if args.full_every is not None and not args.checkpoint:
        parser.error("--full-every is how often a checkpoint is saved whole: pass --checkpoint DIR too")
    if args.checkpoint and args.mode == "geo":
        parser.error("--checkpoint is for --mode sync, async or half_async (a geo trainer's optimizer state is "
                     "its own)")
    if args.checkpoint and args.every is None:
        args.every = 100
    if args.overlap and args.mode not in ("async", "half_async"):
        parser.error(f"--overlap is for --mode async or half_async (a {args.mode} lookup cannot be sent a step early)")


def _size_the_world(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Set ``args.torchrun``, ``args.trainers`` (under torchrun: the ranks that do not serve)
    and ``args.threads`` (this machine's cores shared among its ranks) unless given."""
    args.torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.torchrun:
        world = read_env()["world_size"]
        if args.servers >= world:
            parser.error(f"--servers {args.servers} leaves no trainer among torchrun's {world} processes: "
                         f"pass --servers below {world}, or start more processes (--nproc-per-node, --nnodes)")
        if args.trainers is not None and args.trainers != world - args.servers:
            parser.error(f"--trainers {args.trainers} does not match torchrun's {world} processes minus "
                         f"--servers {args.servers}; leave --trainers out under torchrun")
        args.trainers = world - args.servers
    elif args.trainers is None:
        args.trainers = 2
    if args.threads is None:
        here = int(os.environ.get("LOCAL_WORLD_SIZE", args.servers + args.trainers))
        args.threads = max(1, (os.cpu_count() or 1) // here)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the demo; returns each trainer's figures (the dicts :func:`train` returns, in trainer
    order; under torchrun on trainer0 only, ``[]`` on the other ranks).

    Example::

        results = main(["--steps", "50", "--no-progress", "--plot", ""])
        results[0]["auc"], results[0]["steps_per_s"]
    """
    args = parse_args(argv)
    if args.torchrun:
        with init_from_env(roles={"ps": args.servers, "trainer": args.trainers}, transport=args.transport):
            mine = _rank(args)
            results = _gather(mine)
    else:
        print(f"Starting a local RPC world on loopback: {plural(args.servers, 'server')}, "
              f"{plural(args.trainers, 'trainer')}...", flush=True)
        # the trainers' bars share this terminal: they write under one lock (a file's)
        lock = tempfile.NamedTemporaryFile(prefix="dlrm-demo-bars-", suffix=".lock")
        args.terminal_lock = lock.name
        with lock:
            out = run_local(_rank, args.servers + args.trainers,
                            roles={"ps": args.servers, "trainer": args.trainers}, args=(args,), timeout=900,
                            progress=lambda message: say(f"  {message}"), transport=args.transport)
        results = [r for r in out if r is not None]
    if not results:
        return []
    print("\n" + summary(results, args), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"every trainer's figures (each step's loss, the AUC curves): {args.json}", flush=True)
    if args.plot:
        written = plot(results, args.plot, run_title(args, len(results)))
        rows = ", rows held per server" if any("rows_held_curve" in r for r in results) else ""
        print(f"loss and AUC curves{rows}: {written}" if written
              else "(install matplotlib, e.g. the project's `plot` extra, for a PNG of the loss and AUC curves)")
    return results


def _gather(mine: dict[str, Any] | None) -> list[dict[str, Any]]:
    """torchrun: every trainer's figures on trainer0 (over the trainers' process group), so one
    summary is printed and one PNG written; ``[]`` on the servers and the other trainers."""
    if mine is None:
        return []
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone if dist.get_rank() == 0 else []


if __name__ == "__main__":
    run_script(main)
