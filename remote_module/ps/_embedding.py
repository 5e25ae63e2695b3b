"""ShardedEmbedding and ShardedEmbeddingBag: ``nn.Embedding`` / ``nn.EmbeddingBag`` whose rows
live on parameter servers, sliced into row blocks. Lookups fetch only the unique ids, from the
servers that own them, concurrently (bags are pooled on the servers); ``step()`` pushes only the
touched rows' gradients, which the servers apply with a row-wise optimizer (``_rowwise``)."""

from __future__ import annotations

import threading
import uuid
from typing import Any, Sequence

import torch
import torch.distributed.rpc as rpc
from torch import nn

from remote_module._fanout import _timeout_seconds, call_all, nested_seconds
from remote_module.ps import _tables
from remote_module.ps._dispatch import RoundRobin, check_servers
from remote_module.ps._embedding_checkpoints import TableCheckpoints
from remote_module.ps._geo_cache import GeoCache
from remote_module.ps._rowwise import coalesce, row_optimizer
from remote_module.ps._slicing import _index, _positive_int, block_name, slice_blocks
from rpc_backend.options import positive_seconds

PS_MODES = ("sync", "async", "half_async", "geo")


class ShardedEmbedding(TableCheckpoints, nn.Module):
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
    ) -> None:
        super().__init__()
        # sizes as nn.Embedding takes them: any integer operator.index accepts (numpy.int64...)
        num_embeddings = _positive_int(num_embeddings, "num_embeddings")
        embedding_dim = _positive_int(embedding_dim, "embedding_dim")
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str naming the table, got {name!r}")
        if init not in ("eager", "lazy"):
            raise ValueError(f"init must be 'eager' or 'lazy', got {init!r}")
        if ps_mode not in PS_MODES:
            raise ValueError(f"ps_mode must be one of {', '.join(PS_MODES)}, got {ps_mode!r}")
        num_trainers = _positive_int(num_trainers, "num_trainers")
        geo_push_every = _positive_int(geo_push_every, "geo_push_every")
        half_async_merge_every = _positive_int(half_async_merge_every, "half_async_merge_every")
        min_block_size = _positive_int(min_block_size, "min_block_size")
        merge_s = positive_seconds(half_async_merge_s, "half_async_merge_s")
        timeout = None if timeout is None else positive_seconds(timeout, "timeout")
        seed = _index(seed, "seed")
        if seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        if not (isinstance(optimizer, tuple) and len(optimizer) == 2 and isinstance(optimizer[1], dict)):
            raise TypeError(f"optimizer must be (a torch.optim optimizer class, kwargs dict), got {optimizer!r}")
        if padding_idx is not None:
            padding_idx = _index(padding_idx, "padding_idx")
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx must be within num_embeddings: in [-{num_embeddings}, "
                                 f"{num_embeddings}), got {padding_idx}")
        self.geo_push_every = geo_push_every
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = None if padding_idx is None else padding_idx % num_embeddings
        self.name, self.timeout, self.ps_mode, self.init = name, timeout, ps_mode, init
        self.num_trainers = num_trainers
        self.servers = check_servers(servers)
        blocks = slice_blocks((num_embeddings, embedding_dim), len(self.servers), min_block_size)
        names = [block_name("weight", b.index) for b in blocks]
        chosen = list(split_method(names, self.servers))
        if len(chosen) != len(names) or any(c not in self.servers for c in chosen):
            raise ValueError(
                f"split_method {split_method!r} must return one of the servers {list(self.servers)} per block "
                f"({len(names)} blocks), got {chosen!r:.200}"
            )
        self._ranges = [(b.offset // embedding_dim, b.size // embedding_dim, s) for b, s in zip(blocks, chosen)]
        self._row_opt = row_optimizer(*optimizer)
        spec = _tables.TableSpec(num_embeddings, embedding_dim, torch.float32, init, seed, ps_mode, num_trainers,
                                 self._row_opt, half_async_merge_every, merge_s, self.padding_idx)
        # geo: the rows this trainer touched, trained locally: id -> [row, row when pulled, state]
        self._geo = GeoCache(embedding_dim, self._row_opt) if ps_mode == "geo" else None
        by_server: dict[str, list[tuple[int, int]]] = {}
        for first, count, server in self._ranges:
            by_server.setdefault(server, []).append((first, count))
        self._by_server = by_server
        self._trainer = rpc.get_worker_info().name
        # which object of this trainer pushes (sync: the newest one attached; a retried push of
        # a step is recognised by it)
        self._token = uuid.uuid4().hex
        steps = call_all([(s, _tables._attach_table, (name, spec, rs, self._trainer, self._token))
                          for s, rs in by_server.items()], timeout=timeout)
        self._step = min(steps) if steps else 0
        # the lookups whose rows backward has given a gradient since the last step, by id of the
        # rows tensor: (unique ids, their rows); filled by _record_on_backward's hook
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pending_lock = threading.Lock()
        #: tensor bytes (ids and gradient rows) this module has pushed so far
        self.pushed_bytes = 0
        starts = torch.tensor([first for first, _, _ in self._ranges])
        self.register_buffer("_starts", starts, persistent=False)
        self._server_names = list(by_server)
        # each block's server, as an index into _server_names
        self._block_server = torch.tensor([self._server_names.index(s) for _, _, s in self._ranges], dtype=torch.long)

    def _wait_s(self) -> float:
        """How long a sync lookup may wait on a server for the step: a little less than this
        call's timeout, so the server's answer (naming who has not pushed) arrives first."""
        return nested_seconds(_timeout_seconds(self.timeout))

    def _owner_index(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.searchsorted(self._starts, ids, right=True) - 1

    def _server_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Each of ``ids``' server, as an index into ``_server_names``."""
        if len(self._server_names) == 1:
            return torch.zeros_like(ids)
        return self._block_server[self._owner_index(ids)]

    def _by_owner(self, ids: torch.Tensor, keep: torch.Tensor | None = None,
                  server_of: torch.Tensor | None = None) -> list[tuple[int, str, torch.Tensor | slice]]:
        """For every server of this table, in order: its index, its name and which of ``ids``
        it owns (a mask, within ``keep`` when given; ``ALL`` when one server owns them all, so
        indexing with it copies nothing). ``server_of``: :meth:`_server_of` if computed already."""
        if len(self._server_names) == 1:
            return [(0, self._server_names[0], _tables.ALL if keep is None else keep)]
        server_of = self._server_of(ids) if server_of is None else server_of
        return [(k, server, server_of == k if keep is None else (server_of == k) & keep)
                for k, server in enumerate(self._server_names)]

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        uniq, inverse, rows = self._rows_of(input)
        return rows[inverse].reshape(*input.shape, self.embedding_dim)

    def _unique(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``input`` flattened (checked: integer ids in range), its unique ids, and each
        position's index among them."""
        if not isinstance(input, torch.Tensor) or input.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{type(self).__name__} takes a tensor of integer ids, got "
                            f"{getattr(input, 'dtype', type(input).__name__)}")
        flat = input.reshape(-1).long()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"ids must be in [0, {self.num_embeddings}), got {int(flat.min())}..{int(flat.max())}")
        uniq, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        return flat, uniq, inverse

    def _rows_of(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Unique ids of ``input``, each id's index among them, and their rows (fetched from
        the owning servers concurrently; recorded for :meth:`step` when grad is on)."""
        _, uniq, inverse = self._unique(input)
        # geo: cached rows are this trainer's; only the others are fetched
        wanted = None if self._geo is None else self._geo.missing(uniq)
        calls, taken = [], []
        for _, server, mine in self._by_owner(uniq, wanted):
            ids = uniq[mine]
            if ids.numel():
                calls.append((server, _tables._lookup, (self.name, ids, self._step, None, self._wait_s())))
                taken.append(mine)
        got = call_all(calls, timeout=self.timeout)
        rows = torch.empty(uniq.numel(), self.embedding_dim)
        for mine, r in zip(taken, got):
            rows[mine] = r
            if self._geo is not None:
                self._geo.add(uniq[mine], r)
        if self._geo is not None:
            rows = self._geo.values(uniq)
        if torch.is_grad_enabled():
            rows.requires_grad_(True)
            self._record_on_backward(uniq, rows)
        return uniq, inverse, rows

    def __getstate__(self) -> dict:
        """As nn.Module's, less the lock and the gradients not pushed yet (a copy, e.g.
        ``copy.deepcopy(model)`` for an averaged model, shares the servers' rows, not them)."""
        state = self.__dict__.copy()
        state.pop("_pending_lock", None)
        state["_pending"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._pending_lock = threading.Lock()

    def _record_on_backward(self, uniq: torch.Tensor, rows: torch.Tensor) -> None:
        """Have :meth:`step` push ``rows``' gradient (``rows``: a leaf standing for the rows of
        ``uniq``) once backward has accumulated one into it. Nothing is held before that, as
        with a local module: a lookup that is never backpropagated (an eval loop without
        ``no_grad``) is gone with its output, and ``zero_grad()`` between forward and backward
        (the torch idiom) clears only the gradients accumulated so far."""

        def accumulated(t: torch.Tensor) -> None:  # once per backward through ``rows``
            with self._pending_lock:
                self._pending[id(t)] = (uniq, t)

        rows.register_post_accumulate_grad_hook(accumulated)

    def flush(self) -> None:
        """half_async: have the servers apply the queued pushes now (no-op in other modes)."""
        if self.ps_mode == "half_async":
            call_all([(s, _tables._flush_table, (self.name,)) for s in self._by_server], timeout=self.timeout)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients accumulated since the last :meth:`step` (nothing is pushed); as
        torch's ``zero_grad``, a backward after it (of a forward before it) counts."""
        with self._pending_lock:
            pending, self._pending = self._pending, {}
        for _, rows in pending.values():
            rows.grad = None

    def _geo_step(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        """geo: step the cached rows locally; every ``geo_push_every`` steps push ``row - row
        when fetched`` for the rows cached since the last push, and drop them: a later lookup
        fetches the merged rows, so a push carries only the rows touched in its interval. Each
        row's local optimizer state stays (as a local sparse optimizer keeps it)."""
        geo = self._geo
        if ids.numel():
            uniq, summed = coalesce(ids, grad)
            evicted = geo.missing(uniq)
            if bool(evicted.any()):  # looked up before a push dropped them (a step() between forward and backward)
                with torch.no_grad():
                    self._rows_of(uniq[evicted])
            geo.step(uniq, summed)
        else:
            geo.steps += 1
        if geo.steps % self.geo_push_every:
            return
        ids, deltas = geo.deltas()
        if not ids.numel():
            return
        calls = []
        for _, server, mine in self._by_owner(ids):
            if ids[mine].numel():
                calls.append((server, _tables._push_row_deltas, (self.name, ids[mine], deltas[mine])))
        call_all(calls, timeout=self.timeout)
        self.pushed_bytes += sum(i.numel() * i.element_size() + d.numel() * d.element_size()
                                 for _, _, (_, i, d) in calls)
        geo.drop(ids)

    def step(self) -> None:
        """Push the touched rows' gradients (only those rows) and forget them (geo: step the
        cached rows locally, push their deltas every ``geo_push_every`` steps).

        A step that fails (a server did not answer in time) keeps the gradients, as a failed
        ``optimizer.step()`` keeps ``.grad``: call ``step()`` again to retry it (in sync mode a
        server that already has this step's push takes the retry as a no-op; in async and
        half_async a server that had it applies it again), or ``zero_grad()`` to drop them."""
        with self._pending_lock:
            pending, self._pending = self._pending, {}
        ids_parts, grad_parts = [], []
        for uniq, rows in pending.values():
            if rows.grad is None:
                continue
            if self.padding_idx is None:
                ids_parts.append(uniq)
                grad_parts.append(rows.grad)
            else:
                keep = uniq != self.padding_idx
                ids_parts.append(uniq[keep])
                grad_parts.append(rows.grad[keep])
        ids = torch.cat(ids_parts) if ids_parts else torch.empty(0, dtype=torch.long)
        grad = torch.cat(grad_parts) if grad_parts else torch.empty(0, self.embedding_dim)
        if self.ps_mode == "geo":
            self._geo_step(ids, grad)
            return
        calls = []
        for _, server, mine in self._by_owner(ids):
            # every server hears of a step with any rows (an empty push where it holds none):
            # it is one optimizer step of the whole table, as torch counts steps per parameter
            # (Adagrad's lr_decay, SparseAdam's bias correction); sync: every step, rows or not
            if ids.numel() or self.ps_mode == "sync":
                calls.append((server, _tables._push_rows,
                              (self.name, self._trainer, self._step, ids[mine], grad[mine], self._token)))
        try:
            call_all(calls, timeout=self.timeout)
        except BaseException:
            with self._pending_lock:  # kept for a retry (or zero_grad), with any recorded meanwhile
                for key, entry in pending.items():
                    self._pending.setdefault(key, entry)
            raise
        self.pushed_bytes += sum(i.numel() * i.element_size() + g.numel() * g.element_size()
                                 for _, _, (_, _, _, i, g, _) in calls)
        self._step += 1
