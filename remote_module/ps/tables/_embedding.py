"""ShardedEmbedding: an ``nn.Embedding`` whose rows live on parameter servers, sliced into row
blocks. Lookups fetch only the unique ids, from the servers that own them, concurrently;
``step()`` pushes only the touched rows' gradients (``_pushes``), which the servers apply with
a row-wise optimizer (``ps._rowwise``); backward's gradients are recorded by ``_recording``,
lookups planned ahead by ``_prefetch``. ``ShardedEmbeddingBag`` (``_embedding_bag``) builds on
it, pooling bags on the servers; the servers' side is ``tables.server``."""

from __future__ import annotations

import math
import sys
import threading
import uuid
import warnings
import weakref
from functools import partial
from typing import Any, Callable, Sequence

import torch
import torch.distributed.rpc as rpc
from torch import nn

from remote_module._core import (
    call_all,
    in_torch_save,
    nested_seconds,
    timeout_seconds,
    user_stacklevel,
)
from remote_module.ps._modes import StepRefusal
from remote_module.ps._optimizer import PSOptimizer, class_defaults, watch_local_optimizers
from remote_module.ps._options import TrainingOptions
from remote_module.ps._placement import RoundRobin, block_name, check_servers, place, slice_blocks
from remote_module.ps._rowwise import row_optimizer
from remote_module.ps._steps import Flight, SteppedTable, report_unpushed, wait_for_earlier
from remote_module.ps.tables._checkpoints import TableCheckpoints
from remote_module.ps.tables._geo_cache import GeoCache
from remote_module.ps.tables._lookups import (
    LookupPlan,
    at_step,
    lookup_calls,
    refused_before_attach,
    told_refusals,
)
from remote_module.ps.tables._options import TableOptions
from remote_module.ps.tables._prefetch import Prefetch, PrefetchQueue
from remote_module.ps.tables._pushes import TablePushes
from remote_module.ps.tables._recording import GradientRecording
from remote_module.ps.tables.lifetime._admission import DEFAULT_SKETCH_BYTES
from remote_module.ps.tables.server import _handlers
from remote_module.ps.tables.server._pooling import check_ids
from remote_module.ps.tables.server._requests import RowsRead
from remote_module.ps.tables.server._rows import TableSpec
from remote_module.ps.tables.server._table import ALL
from rpc_backend.watch import add_status


def _trained_rows(geo: GeoCache) -> str | int:
    n = geo.never_sent()  # (the rows of a push in flight are pushed: its failure is warned of as such)
    return f"{n} trained row(s)" if n else 0


def _step_line(table: ShardedEmbedding) -> str:
    """What this trainer's heartbeats say of ``table``: the step it is at."""
    return f"step {table._step} of {type(table).__name__} {table.name!r}"


class ShardedEmbedding(TableCheckpoints, GradientRecording, TablePushes, nn.Module, SteppedTable):
    """An ``nn.Embedding`` (``forward(input)``, same output) whose ``num_embeddings x
    embedding_dim`` rows are sliced into blocks of whole rows over ``servers`` by the same
    rules as a :class:`PSModel`'s parameters (``min_block_size``, ``split_method``).

    ``name`` is job-unique: trainers that pass the same name share one table (and must pass the
    same sizes, servers, mode, optimizer and ``padding_idx``). Sizes and other counts take any
    integer ``operator.index`` takes (``numpy.int64`` too), as torch's. The servers hold the
    rows: ``init="eager"`` creates them all at once; ``init="lazy"`` creates a row on its first
    touch, so a huge table costs memory only for the rows used. Either way a row starts as
    ``N(0, 1)`` drawn from a hash of (``seed``, ``name``, row id): the same rows eager or lazy,
    on any servers, in every run; other tables' and other seeds' rows independent.

    ``sparse`` is torch's keyword, taken so that a port keeps its calls: whatever its value,
    backward gives the looked-up rows' gradients only and the servers step those rows (SGD
    and Adagrad, as a table takes them, step a sparse gradient as torch steps a dense one).

    ``padding_idx`` as ``nn.Embedding``'s: the padding row is created as zeros, a lookup returns
    the row as stored (a checkpoint may set it), and it is never trained (no gradient is
    pushed for it, no optimizer state kept); a bag leaves it out of its pool and its mean.

    After ``loss.backward()``, :meth:`step` pushes ``(row ids, gradient rows)`` for the rows
    this trainer looked up since the last step, and the servers apply ``optimizer``
    (``torch.optim.SGD``, ``Adagrad`` or ``SparseAdam``, as torch steps a sparse gradient) to
    those rows only. ``ps_mode`` as in :class:`PSModel`: ``"sync"`` (each step averages all
    ``num_trainers`` trainers' gradients; lookups wait for the previous step), ``"async"``,
    ``"half_async"`` (pushes summed, applied every ``half_async_merge_every`` pushes or
    ``half_async_merge_s`` seconds), ``"geo"`` (this trainer steps the rows it touched
    locally and every ``geo_push_every`` steps pushes their deltas). Inside a PSModel, the
    PSModel's ``step()`` steps its tables (their mode must be the PSModel's).

    ``state_dict()`` has the local module's key ``weight`` (a lazy table: ``weight.ids`` and
    ``weight.rows``, the touched rows only, which a local module cannot load).

    Long-lived tables (see tutorials/embeddings.md): ``admit_after=k`` (lazy tables) stores an
    id's row only once the id was looked up in ``k`` distinct training steps (counted at the
    push; ``no_grad`` lookups do not count), reading it as its init and dropping its gradients
    until then, counted in a sketch of ``admit_sketch_bytes`` per server; ``evict_after_steps=n``
    drops a row and its optimizer state not stepped in ``n`` of the table's steps (a later
    lookup reads its init again). :meth:`table_stats` reports rows held, admitted, evicted and
    bytes; :meth:`delta_state_dict` / :meth:`load_delta_state_dict` checkpoint only what changed.

    Gradients as a parameter's: the table has one zero-size parameter, ``grad_marker`` (no
    values, never in ``state_dict()``), whose ``.grad`` backward sets. ``zero_grad()`` of any
    module holding the table, or of an optimizer built from its ``parameters()``, sets it to
    ``None``, and the table then drops the gradients recorded before (``zero_grad(
    set_to_none=False)`` zeroes it in place, which a zero-size tensor cannot show: call the
    table's own ``zero_grad()`` then). ``requires_grad_(False)`` freezes the table (nothing
    is recorded). A step without a recorded gradient is no optimizer step (torch skips a
    parameter without one: Adagrad's ``lr_decay`` and SparseAdam's bias correction count
    only steps with one).

    Gradients never pushed warn: the table's rows train only through :meth:`step` (a local
    optimizer of ``model.parameters()`` steps only the zero-size marker). A forward (grad
    enabled) of a table holding gradients recorded before a local ``torch.optim`` optimizer
    stepped (in the thread of the table's forward) and not pushed since, or after
    ``UNPUSHED_BACKWARDS`` (10) backward passes without a step, warns once (``UserWarning``).
    Accumulating gradients over several backward passes before one step is silent.
    The rows step with the lr given in ``optimizer``: a local LR scheduler does not reach it,
    and changing the lr of an optimizer group holding ``grad_marker`` (a scheduler over
    ``model.parameters()``) warns once (``UserWarning``), unless ``ps_optimizer`` is
    scheduled too.

    Example (ps0, ps1 only join RPC and wait)::

        emb = ShardedEmbedding(1_000_000, 16, ["ps0", "ps1"], name="user", ps_mode="async")
        out = emb(torch.tensor([[1, 5], [7, 1]]))     # (2, 2, 16)
        out.sum().backward()
        emb.step()                                    # pushes rows 1, 5, 7 only
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        servers: Sequence[str],
        *,
        name: str,
        padding_idx: int | None = None,
        sparse: bool = False,
        optimizer: tuple[type, dict] = (torch.optim.SGD, {"lr": 0.1}),
        init: str = "eager",
        timeout: float | None = None,
        ps_mode: str = "async",
        num_trainers: int = 1,
        split_method: Any = RoundRobin(),
        min_block_size: int = 8192,
        seed: int = 0,
        geo_push_every: int = 100,
        half_async_merge_every: int = 4,
        half_async_merge_s: float = 0.1,
        admit_after: int = 1,
        admit_sketch_bytes: int = DEFAULT_SKETCH_BYTES,
        evict_after_steps: int | None = None,
    ) -> None:
        super().__init__()
        #: zero-size: backward sets its ``.grad``, ``zero_grad()`` clears it (see the class docstring)
        self.grad_marker = nn.Parameter(torch.empty(0))
        rows = TableOptions(num_embeddings, embedding_dim, init, min_block_size, seed, sparse, padding_idx,
                            admit_after, admit_sketch_bytes, evict_after_steps, ps_mode=ps_mode)
        options = TrainingOptions(name, ps_mode, num_trainers, optimizer, timeout, geo_push_every,
                                  half_async_merge_every, half_async_merge_s, naming="the table")
        self._keep_arguments(options, rows)
        self._place(servers, split_method, rows.min_block_size)
        self._row_opt = row_optimizer(*optimizer)
        #: the servers' row-wise optimizer as a torch.optim.Optimizer (over grad_marker): LR
        #: schedulers drive it; the next push carries its lr (and SparseAdam's betas)
        self.ps_optimizer = PSOptimizer([self.grad_marker], class_defaults(*optimizer), f"table {name!r}")
        self._sent_settings: dict | None = None  # what the servers last took (None: send at the next step)
        # geo: the rows this trainer touched, trained locally: id -> [row, row when pulled, state]
        self._geo = GeoCache(self.embedding_dim, self._row_opt) if ps_mode == "geo" else None
        if self._geo is not None:  # (warns of rows trained here and never pushed: flush() pushes them)
            weakref.finalize(self, report_unpushed, f"table {self.name!r}", partial(_trained_rows, self._geo))
        self._attach(self._spec(options, rows))
        self._pushed_bytes = 0  # (pushed_bytes)
        self._pushes = 0  # steps whose pushes were sent (a prefetch sent before them misses them)
        self._changes = 0  # changes of its rows on the servers other than by a step (loads, flushes)
        # the servers that applied their part of a failed step, which its retry leaves out
        self._took: frozenset[str] = frozenset()
        # what its rows follow, as a load left them: a checkpoint's or a delta's place in a chain
        # of deltas (_checkpoints._chain_place), which the next delta loaded must follow; None: unknown
        self._rows_at: Any = None
        self._warned_lr = False
        self._start_trainer_state()

    def _start_trainer_state(self) -> None:
        """(Construction, and a copy) What this object alone holds, which a copy does not share:
        its locks, its pushes in flight, its prefetches, its gradients recorded, its watch on
        local optimizers."""
        self._pending_lock = threading.Lock()
        self._marker_lock = threading.Lock()  # see _rows_recorded
        self._flight_lock = threading.RLock()  # a step's pushes in flight (_flight) are landed once
        self._flight: Flight | None = None
        #: the prefetched lookups of the next forwards, and the ones prefetching plans after the next step
        self._prefetches = PrefetchQueue()
        # a collection's lookup recorded this table's gradient with others' (_packed), which its
        # step pushes together with theirs (_recording.RecordedTogether), or None
        self._together: Any = None
        self._reset_gradients()
        self._group_lrs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        watch_local_optimizers(self)

    def _keep_arguments(self, options: TrainingOptions, rows: TableOptions) -> None:
        """(Construction) The checked arguments, as the table's attributes."""
        #: torch's keyword, kept as given: the rows' gradients are per row either way
        self.sparse = rows.sparse
        #: an id's row is stored once the id was looked up in this many training steps (lazy tables)
        self.admit_after = rows.admit_after
        self.admit_sketch_bytes = rows.admit_sketch_bytes
        #: a row not stepped in this many of the table's steps is dropped (None: never)
        self.evict_after_steps = rows.evict_after_steps
        self.geo_push_every = options.geo_push_every
        self.num_embeddings, self.embedding_dim = rows.num_embeddings, rows.embedding_dim
        self.padding_idx = rows.padding_idx
        self.name, self.timeout, self.ps_mode, self.init = options.name, options.timeout, options.ps_mode, rows.init
        self.num_trainers = options.num_trainers

    def _place(self, servers: Sequence[str], split_method: Any, min_block_size: int) -> None:
        """(Construction) Slice the rows into blocks over ``servers`` (``split_method`` places
        them): each block's ``(first row, rows, server)``, each server's blocks, and the tensors
        that find an id's server."""
        self.servers = check_servers(servers)
        dim = self.embedding_dim
        blocks = slice_blocks((self.num_embeddings, dim), len(self.servers), min_block_size)
        chosen = place(split_method, [block_name("weight", b.index) for b in blocks], self.servers)
        self._ranges = [(b.offset // dim, b.size // dim, s) for b, s in zip(blocks, chosen)]
        by_server: dict[str, list[tuple[int, int]]] = {}
        for first, count, server in self._ranges:
            by_server.setdefault(server, []).append((first, count))
        self._by_server = by_server
        # each block's first row: a plain attribute, as _block_server, not a buffer (what
        # model.to() / .to_empty() change: model.to("meta") then to_empty() left it uninitialised,
        # and lookups went to the wrong servers; the rows live on the servers, not in the module)
        self._starts = torch.tensor([first for first, _, _ in self._ranges])
        self._server_names = list(by_server)
        # each block's server, as an index into _server_names
        self._block_server = torch.tensor([self._server_names.index(s) for _, _, s in self._ranges], dtype=torch.long)

    def _spec(self, options: TrainingOptions, rows: TableOptions) -> TableSpec:
        """(Construction) What the servers build the table from (every trainer's must agree)."""
        admit_after = rows.admit_after
        return TableSpec(rows.num_embeddings, rows.embedding_dim, torch.float32, rows.init, rows.seed,
                         options.ps_mode, options.num_trainers, self._row_opt, options.half_async_merge_every,
                         options.half_async_merge_s, rows.padding_idx, admit_after,
                         rows.admit_sketch_bytes if admit_after > 1 else 0, rows.evict_after_steps)

    def _attach(self, spec: TableSpec) -> None:
        """(Construction) Create the table on its servers, or attach this trainer to it: this
        object is the one that pushes for the trainer from now on, at the table's step."""
        self._trainer = rpc.get_worker_info().name
        # which object of this trainer pushes (sync: the newest one attached; a retried push of
        # a step is recognised by it)
        self._token = uuid.uuid4().hex
        # (an earlier object of this name: its last step's pushes land first)
        wait_for_earlier(self.name, self.timeout, f"table {self.name!r}")
        attached = call_all([(s, _handlers._attach_table, (self.name, spec, rs, self._trainer, self._token))
                             for s, rs in self._by_server.items()], timeout=self.timeout)
        steps = [step for step, _ in attached]
        self._step = min(steps) if steps else 0
        # a peer that loses this trainer names the step it was at (rpc_backend/watch.py)
        add_status(_step_line, owner=self)
        # (sync: the steps refused before it attached are not this trainer's to be told of)
        refused_before_attach(self.name, [refused for _, refused in attached])

    @property
    def pushed_bytes(self) -> int:
        """Tensor bytes (ids and gradient rows; a collection's push: the pooled bags' gradient,
        sent to each server, with the lookup's ids and bag starts, counted on its first table;
        geo: row deltas) this module has pushed to the servers so far (a push retried after a
        failure counts again; assignable, to reset it)."""
        return self._pushed_bytes

    @pushed_bytes.setter
    def pushed_bytes(self, value: int) -> None:
        self._pushed_bytes = value

    def extra_repr(self) -> str:
        """As torch's (sizes, ``padding_idx``), then where the rows live: ``print(model)``."""
        return ", ".join(self._repr_parts())

    def _repr_parts(self) -> list[str]:
        parts = [f"{self.num_embeddings}, {self.embedding_dim}"]
        if self.padding_idx is not None:
            parts.append(f"padding_idx={self.padding_idx}")
        if self.sparse:
            parts.append("sparse=True")
        parts.append(f"name={self.name!r}, servers={list(self.servers)!r}, ps_mode={self.ps_mode!r}")
        if self.admit_after > 1:
            parts.append(f"admit_after={self.admit_after}")
        if self.evict_after_steps is not None:
            parts.append(f"evict_after_steps={self.evict_after_steps}")
        return parts

    def table_stats(self) -> dict:
        """The table's rows on its servers: ``{"rows_held", "rows_admitted", "rows_evicted",
        "bytes", "merges", "longest_eviction_pause_s", "per_server": {server: the same of that
        server's share, with its "steps"}}``. Rows held: stored now (lazy: the rows created and
        not evicted, evicted ones until a sweep frees them; eager: all); admitted: rows created
        so far (a lazy table's first step of an id admitted, and each re-creation of an evicted
        row); evicted: rows dropped so far; bytes: the rows, their optimizer state, the
        bookkeeping and the admission sketch (storage grows by doubling: up to twice that may be
        allocated); merges: half_async merges applied so far (each server merges its share on
        its own: by count, by its ``half_async_merge_s`` timer, or at a ``flush()``)."""
        self._wait_pushes()
        got = call_all([(s, _handlers._table_stats, (self.name,)) for s in self._by_server], timeout=self.timeout)
        per_server = dict(zip(self._by_server, got))
        out: dict = {k: sum(g[k] for g in got)
                     for k in ("rows_held", "rows_admitted", "rows_evicted", "bytes", "merges")}
        out["longest_eviction_pause_s"] = max((g["longest_eviction_pause_s"] for g in got), default=0.0)
        out["per_server"] = per_server
        return out

    def _wait_s(self) -> float:
        """How long a sync lookup may wait on a server for the step: a little less than this
        call's timeout, so the server's answer (naming who has not pushed) arrives first
        (``math.inf`` in the other modes, whose lookups wait for nothing there)."""
        if self.ps_mode != "sync":
            return math.inf
        return nested_seconds(timeout_seconds(self.timeout))

    def _block_index(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.searchsorted(self._starts, ids, right=True) - 1

    def _server_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Each of ``ids``' server, as an index into ``_server_names``."""
        if len(self._server_names) == 1:
            return torch.zeros_like(ids)
        return self._block_server[self._block_index(ids)]

    def _by_server_of(self, ids: torch.Tensor, keep: torch.Tensor | None = None,
                  server_of: torch.Tensor | None = None) -> list[tuple[int, str, torch.Tensor | slice]]:
        """For every server of this table, in order: its index, its name and which of ``ids``
        it owns (a mask, within ``keep`` when given; ``ALL`` when one server owns them all, so
        indexing with it copies nothing). ``server_of``: :meth:`_server_of` if computed already."""
        if len(self._server_names) == 1:
            return [(0, self._server_names[0], ALL if keep is None else keep)]
        server_of = self._server_of(ids) if server_of is None else server_of
        return [(k, server, server_of == k if keep is None else (server_of == k) & keep)
                for k, server in enumerate(self._server_names)]

    def _dtype(self) -> torch.dtype:
        """The dtype of this module's outputs: its ``grad_marker``'s, as ``nn.Embedding``'s
        output is its weight's (``model.double()`` / ``.half()`` / ``.to(dtype)`` set it; the
        servers keep float32 rows)."""
        dtype = self.grad_marker.dtype
        return dtype if dtype.is_floating_point else torch.float32

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._looked_up((input,), self._forward_plan)

    def _forward_plan(self, input: torch.Tensor) -> LookupPlan:
        """:meth:`forward` in two halves (:class:`LookupPlan`)."""
        rows = self._rows_plan(input)
        return LookupPlan(rows.calls, partial(self._embedded, rows.finish, input.shape))

    def _embedded(self, rows_of: Callable[[list], tuple], shape: torch.Size, got: list) -> torch.Tensor:
        """A forward's output of the answers ``got`` of :meth:`_rows_plan`'s calls
        (``rows_of``: that plan's ``finish``), as ``input`` of ``shape`` looked up."""
        _, inverse, rows = rows_of(got)
        return rows[inverse].reshape(*shape, self.embedding_dim)

    def prefetch(self, input: torch.Tensor) -> Prefetch:
        """Plan the lookup of ``input`` now (checked as :meth:`forward` checks it) for the next
        forward: sent with the next :meth:`step`'s pushes, one message per server, whose
        servers answer it once they applied them (what a lookup right after the step would
        see: results are those without prefetch, in every mode), or sent by that forward when
        no step comes first. The next forward with an equal ``input`` (by value) consumes it;
        any other forward drops it; a new prefetch replaces it. Returns the handle."""
        return self._prefetch((input,), self._forward_plan)

    def _prefetch(self, key: tuple, plan: Callable, queued: bool = False, overlap: bool = False) -> Prefetch:
        """A prefetch of ``key``; ``queued`` (``prefetching``: a batch after the next, planned
        while a step's answer is awaited): after the others, for a later forward (the lookup
        planned here waits for no push: it is sent after them)."""
        records = self._plan_state()
        calls, finish = plan(*key)  # (the checks of the forward's arguments, now)
        # geo: the lookup depends on the rows this trainer caches, which its step changes
        handle = Prefetch(key, records, calls, finish, replan=self.ps_mode == "geo", tables=[self], overlap=overlap)
        with self._flight_lock:
            self._prefetches.add(handle, queued)
        return handle

    def _prefetch_input(self, value: Any, queued: bool = False, overlap: bool = False) -> Prefetch:
        """(``prefetching``) a prefetch of a batch's input: the ids."""
        return self._prefetch((value,), self._forward_plan, queued, overlap)

    def _looked_up(self, key: tuple, plan: Callable) -> Any:
        """A forward's output: of the prefetch of ``key`` when there is one (any other is
        dropped), else of a lookup planned and sent now; after a step's pushes landed."""
        records = self._plan_state()
        with self._flight_lock:
            handle = self._prefetches.claim(key, records, self._wait_pushes)
        try:
            return PrefetchQueue.output(handle, lambda calls: lookup_calls(at_step(calls, self._step_of), self.timeout),
                                lambda: plan(*key))
        except StepRefusal as exc:  # (a sync step of the table refused: raised here once)
            told_refusals(exc, [self.name])
            raise

    def _plan_state(self) -> tuple:
        """What a lookup's plan depends on besides its arguments: whether it records gradients,
        and the output dtype (a collection reads the same of all its tables at once:
        ``ShardedEmbeddingBagCollection._plan_states``)."""
        marker = self.grad_marker
        dtype = marker.dtype  # (as _dtype(), read once)
        return torch.is_grad_enabled() and marker.requires_grad, dtype if dtype.is_floating_point else torch.float32

    def _reader(self) -> Callable:
        """The handler of this table's row and bag lookups: one that waits for the step in sync
        mode, else one answered at once (no Future on the server)."""
        return _handlers._rows_for if self.ps_mode == "sync" else _handlers._rows_now

    def _step_of(self, name: str) -> int:
        return self._step

    def _applied_or_told(self) -> None:
        """(sync) Wait until this trainer's last step is applied on every server (a lookup of no
        ids at that step); a step of the table the servers refused that this trainer was not
        told of raises here, once, as its next lookup would (:func:`told_refusals`): a job whose
        last step was refused hears of it at its checkpoint (``flush()`` waits for no other
        trainer: a sync step it pushed is told of at the next lookup or checkpoint)."""
        no_ids = torch.empty(0, dtype=torch.long)
        calls = [(s, _handlers._rows_for, RowsRead(self.name, no_ids, self._step, None, self._wait_s()))
                 for s in self._by_server]
        try:
            call_all(at_step(calls, self._step_of), timeout=self.timeout)
        except StepRefusal as exc:
            told_refusals(exc, [self.name])
            raise

    def _wait_pushes(self) -> None:
        """Wait for this table's pushes in flight (its last step's, or a collection's step's),
        raising a failed push's error (once; the gradients are kept for a retry)."""
        if self._flight is None:
            return
        with self._flight_lock:
            flight, self._flight = self._flight, None
            if flight is not None:
                flight.land()

    def _join_flight(self, flight: Flight) -> None:
        """The pushes of a step its holder sent (a PSModel's, a collection's) are in flight: the
        next call on this table lands them first."""
        self._flight = flight

    def _unique(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``input`` flattened (checked: integer ids in range), its unique ids, and each
        position's index among them."""
        flat = self._checked_ids(input)
        uniq, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        return flat, uniq, inverse

    def _check_id_tensor(self, input: Any) -> None:
        """``TypeError`` unless ``input`` is a tensor of integer ids (int32 or int64)."""
        if not isinstance(input, torch.Tensor) or input.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{type(self).__name__} takes a tensor of integer ids, got "
                            f"{getattr(input, 'dtype', type(input).__name__)}")

    def _checked_ids(self, input: torch.Tensor) -> torch.Tensor:
        """``input`` flattened as int64 ids, checked: an integer tensor, ids in range."""
        self._check_id_tensor(input)
        flat = input.reshape(-1).long()
        check_ids(flat, self.num_embeddings)
        return flat

    def _rows_of(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Unique ids of ``input``, each id's index among them, and their rows (fetched from
        the owning servers concurrently; recorded for :meth:`step` when grad is on)."""
        calls, finish = self._rows_plan(input)
        return finish(lookup_calls(calls, self.timeout))

    def _rows_plan(self, input: torch.Tensor, wait_s: float | None = None) -> LookupPlan:
        """:meth:`_rows_of` in two halves (:class:`LookupPlan`: the host calls that fetch the
        rows, and what makes its result of their answers, so that a collection can send several
        tables' calls to a server in one message). ``wait_s``: how long a sync lookup may wait
        on a server for the step (default :meth:`_wait_s`; a collection's budget is its own)."""
        wait_s = self._wait_s() if wait_s is None else wait_s
        _, uniq, inverse = self._unique(input)
        # geo: cached rows are this trainer's; only the others are fetched
        wanted = None if self._geo is None else self._geo.missing(uniq)
        calls, taken = [], []
        for _, server, mine in self._by_server_of(uniq, wanted):
            ids = uniq[mine]
            if ids.numel():
                calls.append((server, self._reader(), RowsRead(self.name, ids, self._step, None, wait_s)))
                taken.append(mine)
        return LookupPlan(calls, partial(self._rows_fetched, uniq, inverse, taken))

    def _rows_fetched(self, uniq: torch.Tensor, inverse: torch.Tensor, taken: list,
                      got: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`_rows_plan`'s result of its calls' answers ``got`` (the rows of ``uniq`` where
        ``taken``, each call's share of them, says), recorded for the step when grad is on."""
        rows = torch.empty(uniq.numel(), self.embedding_dim)
        for mine, r in zip(taken, got):
            rows[mine] = r
            if self._geo is not None:
                self._geo.add(uniq[mine], r)
        if self._geo is not None:
            rows = self._geo.values(uniq)
        if self._records_gradients():
            rows = self._rows_recorded(uniq, rows)
        return uniq, inverse, rows.to(self._dtype())

    #: bookkeeping set at every lookup, backward and step (never a tensor, parameter or module):
    #: stored without ``nn.Module.__setattr__``'s checks, which cost a collection of 8 tables
    #: about 100 calls per training step
    _PLAIN_ATTRIBUTES = frozenset({"_forward_thread", "_fresh", "_held", "_backwards", "_stepped_past", "_pushes",
                                   "_pushed_bytes", "_step", "_flight", "_changes", "_took", "_together",
                                   "_bags_known"})

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ShardedEmbedding._PLAIN_ATTRIBUTES:
            object.__setattr__(self, name, value)
        elif name == "weight":  # (a local parameter named so would be left out of every lookup, silently)
            raise AttributeError(self._no_weight(f"{type(self).__name__} takes no local 'weight'"))
        else:
            super().__setattr__(name, value)

    @property
    def grad_marker(self) -> nn.Parameter:
        """The zero-size parameter whose ``.grad`` backward sets (see the class docstring): a
        registered parameter, read here without ``nn.Module.__getattr__`` (a training step reads
        it about a dozen times)."""
        try:
            return self._parameters["grad_marker"]
        except KeyError:  # (not registered yet: nn.Module registers it, as it registers any parameter)
            raise AttributeError(f"'{type(self).__name__}' object has no attribute 'grad_marker'") from None

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name != "weight":
                raise
        raise AttributeError(self._no_weight(f"'{type(self).__name__}' object has no attribute 'weight'"))

    def _no_weight(self, what: str) -> str:
        """The error for ``table.weight`` (``table.weight.data = W``, weight tying): where the rows
        are, and the calls that set and read them."""
        if getattr(self, "init", None) == "lazy":
            load = 'load_state_dict({"weight.ids": torch.arange(len(W)), "weight.rows": W})'
        else:
            load = 'load_state_dict({"weight": W})'
        return (f"{what}: table {getattr(self, 'name', '?')!r} keeps its rows on the parameter servers, "
                f"not in a local tensor. To start it from given values W (as `table.weight.data = W` or "
                f"from_pretrained(W) starts a local {type(self).__name__.replace('Sharded', 'nn.')}), call "
                f"table.{load} once (one trainer: every trainer of the job shares the rows); to read them, "
                "table.state_dict() (lookups of ids read rows too)")

    def __getstate__(self) -> dict:
        """As nn.Module's, less the lock and the gradients not pushed yet (a copy, e.g.
        ``copy.deepcopy(model)`` for an averaged model, shares the servers' rows, not them)."""
        self._wait_pushes()
        if _in_torch_save():
            warnings.warn(
                "torch.save of a model holding sharded tables saves the tables' handles, not their rows: "
                "torch.load gives a model reading the servers' rows as they are then (in a new job, none: its "
                "lookups raise LookupError). Save model.state_dict() (and the tables' optimizer_state_dict()) "
                "to keep the rows", UserWarning, stacklevel=user_stacklevel())
        state = self.__dict__.copy()
        for key in ("_pending_lock", "_marker_lock", "_fresh", "_held", "_hooked", "_group_lrs", "_flight_lock",
                    "_flight", "_prefetches", "_together"):
            del state[key]
        state.pop("_row_settings_of", None)  # (TablePushes._row_settings' last: the copy's optimizer is another)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        # a copy is another object of the table: in sync mode its pushes are refused (one trainer,
        # one object), never taken as retries of the original's (which would drop them silently)
        self._token = uuid.uuid4().hex
        self._start_trainer_state()

    def flush(self) -> None:
        """Wait for this table's pushes in flight; half_async: have the servers apply the queued
        pushes now; geo: push the deltas of the rows trained since the last push now (the end
        of training: the local steps after the last ``geo_push_every`` boundary), as a push
        every ``geo_push_every`` steps does."""
        self._wait_pushes()
        if self._geo is not None and self._geo.trained():
            self._geo_push()
        if self.ps_mode == "half_async":
            call_all([(s, _handlers._flush_table, (self.name,)) for s in self._by_server], timeout=self.timeout)
            self._changes += 1  # a prefetch sent before reads stale rows

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients accumulated since the last :meth:`step` (nothing is pushed); as
        torch's ``zero_grad``, a backward after it (of a forward before it) counts. Waits for
        the pushes in flight first (a failed one raises here, as at any call on the table)."""
        self._wait_pushes()
        super().zero_grad(set_to_none)
        self._together = None
        self._took = frozenset()  # (a failed step dropped: the next one is whole)
        with self._pending_lock:
            self._held, self._fresh = [], []
            self._backwards, self._stepped_past = 0, False


def _in_torch_save() -> bool:
    """Whether ``torch.save`` is pickling the caller (:func:`in_torch_save`): a table pickled
    there leaves its rows behind, where ``copy.deepcopy`` and ``pickle`` (a copy sharing the
    servers' rows, as documented) do not warn."""
    return in_torch_save(sys._getframe(2))
