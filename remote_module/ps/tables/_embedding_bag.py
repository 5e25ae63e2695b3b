"""ShardedEmbeddingBag: bags of a sharded table, pooled on the servers that own the rows."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch import nn

from remote_module._core import backward_accumulates
from remote_module.ps.tables._embedding import ShardedEmbedding
from remote_module.ps.tables._lookups import LookupPlan
from remote_module.ps.tables._prefetch import Prefetch
from remote_module.ps.tables._recording import BagsGradient
from remote_module.ps.tables.server import _handlers
from remote_module.ps.tables.server._pooling import check_offsets, with_padding_row
from remote_module.ps.tables.server._requests import BagsRead, RowsRead
from remote_module.ps.tables.server._table import ALL


def _as_dtype(dtype: torch.dtype, got: list) -> torch.Tensor:
    """A whole lookup's output (its one call's answer) in the module's ``dtype``."""
    return got[0].to(dtype)


class _BagRows(torch.autograd.Function):
    """The pooled bags (computed on the servers) as a function of the rows of the unique ids,
    for backward: row ``u``'s gradient is the sum, over the positions ``j`` holding it, of its
    bag's gradient times ``weights[j]`` (sum) or over its bag's size (mean), as torch's
    ``embedding_bag`` backward gives it (a direct ``index_add``: several times faster than
    running that backward on zero rows)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, pooled: torch.Tensor, inverse: torch.Tensor, bags: torch.Tensor,
                weights: torch.Tensor | None, sizes: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(inverse, bags, weights, sizes)
        ctx.shape = rows.shape
        return pooled.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        inverse, bags, weights, sizes = ctx.saved_tensors
        if sizes is not None:
            grad = grad / sizes
        per_position = grad.index_select(0, bags)
        if weights is not None:
            per_position = per_position * weights.to(per_position.dtype).unsqueeze(1)
        rows = torch.zeros(ctx.shape, dtype=grad.dtype).index_add_(0, inverse, per_position)
        return rows, None, None, None, None, None


class _BagsGradient(torch.autograd.Function):
    """The pooled bags of a float32 sum or mean lookup of the servers' rows (no padding row, no
    ``per_sample_weights``), recorded for the table's step in one node: backward hands the
    table a :class:`BagsGradient` (the bags' gradient, as torch's ``embedding_bag`` backward
    starts from it) and gives the grad marker a zero-size gradient, as ``_RowsForStep`` does;
    the servers make each position's gradient of it at the push. The trainer neither
    deduplicates the ids nor sums the rows."""

    @staticmethod
    def forward(ctx: Any, pooled: torch.Tensor, marker: torch.Tensor, record: tuple) -> torch.Tensor:
        # record: (keep, the marker's AccumulateGrad, the _Pooling, each bag's size or None), one
        # argument (Function.apply looks at each argument it is given)
        ctx.keep, ctx.accumulator, ctx.pooling, ctx.sizes = record
        ctx.marker = (marker.dtype, marker.device)
        return pooled.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        # as a parameter's .grad: only a backward that accumulates into the marker records
        if backward_accumulates(ctx.accumulator):
            # kept until the step, so a copy: the gradient given may be the caller's own tensor
            # (out.backward(g), a reused buffer), which it may change before step() (as a
            # local module's backward has used it by then)
            grad = grad.clone() if ctx.sizes is None else grad / ctx.sizes
            pooling = ctx.pooling
            ctx.keep(BagsGradient(pooling.flat, pooling.bags, pooling.shares, grad))
        dtype, device = ctx.marker
        return None, torch.zeros(0, dtype=dtype, device=device), None


class _Bags(NamedTuple):
    """The bags of a lookup (:meth:`ShardedEmbeddingBag._keep_bags`), with what identifies them."""

    shape: torch.Size  # the input's
    dtype: torch.dtype  # the output's
    mode: str  # the table's bag_mode
    offsets: torch.Tensor | None  # a copy of the offsets (None: a 2-d input)
    num_bags: int
    bags: torch.Tensor  # each position's bag
    positions: torch.Tensor  # arange(num_bags)
    starts_alone: torch.Tensor | None  # each bag's first position, when one server gets every position


class _Pooling(NamedTuple):
    """A bag lookup whose rows the servers pool (:meth:`ShardedEmbeddingBag._lookup_plan`):
    what making its output of their answers needs."""

    kind: str  # how the servers pool: "sum" (sum and mean bags) or "max"
    called: list[int]  # the servers called, as indices into the table's _server_names
    flat: torch.Tensor  # the input's ids, flat
    uniq: torch.Tensor | None  # its unique ids (None: it records no gradient)
    inverse: torch.Tensor | None  # each position's index in uniq
    bags: torch.Tensor  # each position's bag
    weights: torch.Tensor | None  # per_sample_weights, flat
    keep: torch.Tensor | None  # the positions that are not the padding row (None: no padding_idx)
    holder: torch.Tensor | None  # zero rows standing for uniq, which backward gives the rows' gradient (None: unused)
    zero: torch.Tensor | None  # torch's embedding_bag of the zero rows (max pooling; None: known bags, sum)
    server_of: torch.Tensor | None  # each position's server (None: one server, sum pooling)
    num_bags: int
    grad: bool  # whether it records gradients (recorded when the output is made)
    dtype: torch.dtype  # the output's
    bags_form: bool  # recorded as its bags' gradient (_BagsGradient): no unique ids, no holder
    shares: dict  # per server index called: (the ids sent there, each bag's first position among them)


class ShardedEmbeddingBag(ShardedEmbedding):
    """An ``nn.EmbeddingBag`` (``forward(input, offsets=None, per_sample_weights=None)``,
    ``mode="sum" | "mean" | "max"``, ``padding_idx``, ``include_last_offset``; ``max_norm``
    and ``scale_grad_by_freq`` are refused) whose rows live on parameter servers, as
    :class:`ShardedEmbedding` (every other keyword is its; the PS mode is ``ps_mode``, since
    ``mode`` is the bag's pooling, as torch names it).

    Outputs equal a local ``nn.EmbeddingBag`` up to float32 rounding of the changed order of
    summation (the servers pool their own rows, the trainer adds the partial results).

    Example::

        bag = ShardedEmbeddingBag(1_000_000, 16, ["ps0", "ps1"], name="items", mode="sum")
        out = bag(torch.tensor([1, 2, 4, 5, 4]), offsets=torch.tensor([0, 2]))   # (2, 16)
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, servers: Sequence[str], *,
                 mode: str = "mean", ps_mode: str = "async", padding_idx: int | None = None,
                 include_last_offset: bool = False, max_norm: float | None = None, norm_type: float = 2.0,
                 scale_grad_by_freq: bool = False, **kwargs: Any) -> None:
        if mode not in ("sum", "mean", "max"):
            raise ValueError(f"mode must be 'sum', 'mean' or 'max', got {mode!r}")
        if max_norm is not None:
            raise ValueError("max_norm is not supported by sharded tables (torch renormalises the looked-up rows "
                             "in place at every lookup; the rows live on the servers): leave it None")
        if scale_grad_by_freq:
            raise ValueError("scale_grad_by_freq=True is not supported by sharded tables: leave it False")
        if not isinstance(include_last_offset, bool):
            raise TypeError(f"include_last_offset must be a bool, as torch's, got {include_last_offset!r}")
        super().__init__(num_embeddings, embedding_dim, servers, ps_mode=ps_mode, padding_idx=padding_idx, **kwargs)
        self.bag_mode = mode
        #: torch's: 1-d offsets carry one more element, the end of the last bag (CSR form)
        self.include_last_offset = include_last_offset
        self._bags_known: _Bags | None = None  # the last lookup's bags (_keep_bags)

    def __getstate__(self) -> dict:
        """As :class:`ShardedEmbedding`'s, less the last lookup's bags (this trainer's, as big
        as its batch: a copy or ``torch.save(model)`` of the table does not carry them)."""
        state = super().__getstate__()
        state["_bags_known"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        state.setdefault("_bags_known", None)  # (a table pickled before it kept them)
        super().__setstate__(state)

    def _repr_parts(self) -> list[str]:
        parts = super()._repr_parts()
        extra = [f"mode={self.bag_mode!r}"] + (["include_last_offset=True"] if self.include_last_offset else [])
        return parts[:1] + extra + parts[1:]

    def _bag_args(self, input: Any, offsets: Any, per_sample_weights: Any) -> tuple:
        """The arguments as a table without ``include_last_offset`` takes them: 1-d offsets of
        ``B + 1`` elements (the last one the input's length, as torch documents it) become the
        ``B`` bags' starts. torch refuses no offsets, as here; a last offset other than the
        input's length is refused (torch's mean divides the last bag by the rest of the input)."""
        if not (self.include_last_offset and isinstance(input, torch.Tensor) and input.dim() == 1
                and isinstance(offsets, torch.Tensor) and offsets.dim() == 1):
            return input, offsets, per_sample_weights  # 2-d input: torch ignores it too
        if not offsets.numel():
            raise RuntimeError("include_last_offset: number of offset should be at least 1")
        end = int(offsets[-1])
        if end != input.numel():
            raise ValueError(f"include_last_offset=True: the last offset must be the input's length {input.numel()} "
                             f"(the end of the last bag, as torch documents it), got {end}")
        return input, offsets[:-1], per_sample_weights

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Bags of rows pooled as ``nn.EmbeddingBag`` does (same arguments, same errors).

        The servers pool their own rows of each bag (sums, weighted by ``per_sample_weights``;
        a mean is the sum over the bag's size; maxima with the row that holds each), so only
        ``(bags, dim)`` partial results travel. In geo mode, and when ``per_sample_weights``
        needs a gradient (which needs the rows), the rows are fetched and pooled here instead.

        A float32 sum or mean lookup that records gradients, without ``padding_idx`` or
        ``per_sample_weights``, is recorded as its pooled bags' gradient: the next
        :meth:`step` sends each server the ids this lookup sent it, with the gradient of the
        bags holding them, and the server applies each position's gradient (summed per row, the
        bits the trainer would sum, or added in order for SGD), so the trainer does not
        deduplicate the ids. Several lookups in one step push their rows' gradients, computed
        here.
        """
        return self._looked_up(self._bag_args(input, offsets, per_sample_weights), self._lookup_plan)

    def prefetch(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                 per_sample_weights: torch.Tensor | None = None) -> Prefetch:
        """:meth:`ShardedEmbedding.prefetch` of a bag lookup: the next :meth:`forward` with
        equal arguments (by value) consumes it."""
        return self._prefetch(self._bag_args(input, offsets, per_sample_weights), self._lookup_plan)

    def _prefetch_input(self, value: Any, queued: bool = False, overlap: bool = False) -> Prefetch:
        """(``prefetching``) a prefetch of a batch's input: the ids, or ``(input, offsets,
        per_sample_weights)``."""
        args = tuple(value) + (None,) * (3 - len(value)) if isinstance(value, (tuple, list)) else (value, None, None)
        return self._prefetch(self._bag_args(*args), self._lookup_plan, queued, overlap)

    def _lookup_plan(self, input: torch.Tensor, offsets: torch.Tensor | None,
                     per_sample_weights: torch.Tensor | None,
                     wait_s: float | None = None) -> LookupPlan:
        """:meth:`forward` in two halves (:class:`LookupPlan`): the host calls of this lookup, and
        what makes the output of their answers (so that a collection can send several tables' calls to a
        server in one message). Arguments are checked here, before anything is sent; offsets
        given with ``include_last_offset`` are converted first (:meth:`_bag_args`).
        ``wait_s``: as for :meth:`_rows_plan`."""
        wait_s = self._wait_s() if wait_s is None else wait_s
        records = torch.is_grad_enabled() and self.grad_marker.requires_grad
        needs_rows = self._needs_rows(per_sample_weights)
        if not records and self._sent_as_given(per_sample_weights):
            return self._whole_plan(input, offsets, per_sample_weights, wait_s)
        dtype = self._dtype()  # the model's (e.g. after model.double()); the servers pool float32
        known = None if needs_rows else self._known_bags(input, offsets, per_sample_weights, dtype)
        if known is None:
            check_offsets(offsets)
        if needs_rows:
            return self._pool_here_plan(input, offsets, per_sample_weights, wait_s)
        # a float32 sum or mean lookup that records, without padding row or weights, is recorded
        # as its bags' gradient (the servers compute the rows' gradients at the push)
        bags_form = (records and self.bag_mode != "max" and dtype == torch.float32 and self.padding_idx is None
                     and per_sample_weights is None)
        if records and not bags_form:
            flat, uniq, inverse = self._unique(input)
            grad = True  # recorded when the output is made (_pooled): a prefetch's, at its forward
            # zero rows standing for the unique ids: torch's own embedding_bag on them checks the
            # arguments as nn.EmbeddingBag does and gives the output's shape; backward puts each
            # row's gradient into them (_BagRows for sum and mean, an index_put for max)
            holder = torch.zeros(uniq.numel(), self.embedding_dim, dtype=dtype)
            pad = None
            if self.padding_idx is not None:
                hit = (uniq == self.padding_idx).nonzero().reshape(-1)
                pad = int(hit[0]) if hit.numel() else None
            index = inverse.reshape(input.shape)
        else:
            # no unique ids needed (the servers pool every position, and compute the rows'
            # gradients of a lookup in the bags' form); one zero row still lets torch's
            # embedding_bag check the arguments and give the shape
            flat, grad = self._checked_ids(input), bags_form
            uniq = inverse = None
            # (known bags are of sum or mean pooling, whose output never needs the zero row)
            holder = torch.zeros(1, self.embedding_dim, dtype=dtype) if known is None else None
            pad, index = None, None
        kind = "max" if self.bag_mode == "max" else "sum"
        if known is None:
            if index is None:
                index = torch.zeros(input.shape, dtype=torch.long)
            with torch.no_grad():
                zero = nn.functional.embedding_bag(index, holder, offsets, mode=self.bag_mode,
                                                   per_sample_weights=per_sample_weights, padding_idx=pad)
            num_bags = zero.shape[0]
            if input.dim() == 2:
                bags = torch.arange(num_bags).repeat_interleave(input.shape[1])
            else:
                bags = torch.searchsorted(offsets.long(), torch.arange(flat.numel()), right=True) - 1
            positions = torch.arange(num_bags)
            known = self._keep_bags(input, offsets, per_sample_weights, dtype, kind, num_bags, bags, positions)
        else:
            zero = None  # (kept for sum and mean bags only, whose output is never the zero bags)
        num_bags, bags, positions, starts_alone = known.num_bags, known.bags, known.positions, known.starts_alone
        weights = None if per_sample_weights is None else per_sample_weights.reshape(-1).detach()
        keep = flat != self.padding_idx if self.padding_idx is not None else None
        server_of = self._server_of(flat) if kind == "max" or len(self._server_names) > 1 else None
        calls, called, shares = [], [], {}
        wire = torch.int32 if self.num_embeddings <= 2**31 else torch.int64  # ids travel as int32 when they fit
        for k, server, mine in self._by_server_of(flat, keep, server_of):
            ids = flat if mine is ALL else flat[mine]
            if not ids.numel():
                continue
            w = None if weights is None else weights[mine]
            # this server's share of each bag starts where its positions reach that bag
            starts = starts_alone if mine is ALL else torch.searchsorted(bags[mine], positions)
            # (a copy: ``flat`` may be the caller's int64 ids, which may change before the step
            # pushes the bags' gradient by ``sent``; int32 ids are copied by the cast anyway)
            sent = ids.to(wire, copy=mine is ALL)
            calls.append((server, self._reader(), RowsRead(self.name, sent, self._step, (starts, w, kind), wait_s)))
            called.append(k)
            if bags_form:
                shares[k] = (sent, starts)
        pooling = _Pooling(kind, called, flat, uniq, inverse, bags, weights, keep, holder, zero, server_of, num_bags,
                           grad, dtype, bags_form, shares)
        return LookupPlan(calls, partial(self._pooled, pooling))

    def _known_bags(self, input: torch.Tensor, offsets: Any, per_sample_weights: Any,
                    dtype: torch.dtype) -> _Bags | None:
        """The bags of the last lookup (:meth:`_keep_bags`) when this one's are the same: the same
        input shape and offsets (by value), no ``per_sample_weights``, the same output dtype and
        ``bag_mode``. Its arguments then passed the checks of offsets and torch's ``embedding_bag``
        already, which this one would pass again; None otherwise."""
        known = self._bags_known
        if (known is None or per_sample_weights is not None or not isinstance(input, torch.Tensor)
                or known.shape != input.shape or known.dtype != dtype or known.mode != self.bag_mode):
            return None
        if known.offsets is None:
            return known if offsets is None else None
        if not (isinstance(offsets, torch.Tensor) and offsets.dtype == known.offsets.dtype
                and offsets.shape == known.offsets.shape and torch.equal(offsets, known.offsets)):
            return None
        return known

    def _keep_bags(self, input: torch.Tensor, offsets: Any, per_sample_weights: Any, dtype: torch.dtype, kind: str,
                   num_bags: int, bags: torch.Tensor, positions: torch.Tensor) -> _Bags:
        """The bags of a lookup whose arguments passed the checks, kept for the next lookup of
        the same bags (sum and mean pooling without ``per_sample_weights``: a batch's layout
        usually repeats from step to step); returned."""
        alone = len(self._server_names) == 1 and self.padding_idx is None
        kept = None if offsets is None else offsets.detach().clone()
        known = _Bags(input.shape, dtype, self.bag_mode, kept, num_bags, bags, positions,
                      torch.searchsorted(bags, positions) if alone else None)
        if kind == "sum" and per_sample_weights is None:
            self._bags_known = known
        return known

    def _needs_rows(self, per_sample_weights: Any) -> bool:
        """Whether a lookup pools the fetched rows here: geo mode (the cached rows are the
        values), or ``per_sample_weights`` that need a gradient (which needs the rows)."""
        return self.ps_mode == "geo" or (
            per_sample_weights is not None and per_sample_weights.requires_grad and torch.is_grad_enabled())

    def _sent_as_given(self, per_sample_weights: Any) -> bool:
        """Whether a lookup goes to the server as given (:meth:`_whole_plan`): it records
        nothing, one server holds the table and the rows are pooled there (weights of another
        dtype than the module's are refused here instead, as torch refuses them)."""
        return (not (torch.is_grad_enabled() and self.grad_marker.requires_grad)
                and not self._needs_rows(per_sample_weights) and len(self._server_names) == 1
                and (per_sample_weights is None or getattr(per_sample_weights, "dtype", None) == self._dtype()))

    def _whole_plan(self, input: torch.Tensor, offsets: torch.Tensor | None, per_sample_weights: torch.Tensor | None,
                    wait_s: float) -> LookupPlan:
        """A lookup that records nothing, of a table one server holds whole: the arguments
        travel as given and the server pools them as ``nn.EmbeddingBag`` would
        (:meth:`Table.bags`: the same checks, errors and sums), so the trainer does no work."""
        self._check_id_tensor(input)
        weights = None if per_sample_weights is None else per_sample_weights.detach()
        handler = _handlers._bags_when_applied if self.ps_mode == "sync" else _handlers._bags_now
        calls = [(self._server_names[0], handler,
                  BagsRead(self.name, input, offsets, weights, self.bag_mode, self._step, wait_s))]
        return LookupPlan(calls, partial(_as_dtype, self._dtype()))

    def _pooled(self, pooling: _Pooling, got: list) -> torch.Tensor:
        """The output of a lookup from the servers' answers ``got`` (see :meth:`_lookup_plan`)."""
        (kind, called, flat, uniq, inverse, bags, weights, keep, holder, zero, server_of, num_bags, grad, dtype,
         bags_form, _) = pooling
        if grad:
            grad = self._records_gradients()  # (warns of gradients never pushed, as every recording lookup)
            if grad and not bags_form:
                holder = self._rows_recorded(uniq, holder)
        if kind == "sum":
            if len(got) == 1:  # (the servers pool float32)
                total = got[0]
            else:
                total = torch.zeros(num_bags, self.embedding_dim, dtype=torch.float32)  # (whatever the default dtype)
                for part in got:  # in server order
                    total = total + part
            sizes = None
            if self.bag_mode == "mean":
                counts = torch.bincount(bags if keep is None else bags[keep], minlength=num_bags)
                sizes = counts.clamp(min=1).unsqueeze(1).to(total.dtype)
                total = total / sizes
            total = total.to(dtype)
            if not grad:
                return total
            if bags_form:
                return self._bags_recorded(pooling, total, sizes)
            if keep is not None:
                inverse, bags, weights = inverse[keep], bags[keep], None if weights is None else weights[keep]
            return _BagRows.apply(holder, total, inverse, bags, weights, sizes)
        if not got:
            # no row but padding: backward still reaches the (padding) rows, as torch's gives the
            # weight a gradient, so the step counts
            return zero + holder.sum() * 0.0 if grad else zero
        value, winner = self._merge_maxima(got, called, flat, bags, keep, server_of, num_bags)
        found = winner >= 0
        out = torch.where(found, value, 0.0)
        if grad:
            b, d = found.nonzero(as_tuple=True)
            row = torch.searchsorted(uniq, winner[b, d])
            out = out + torch.zeros(num_bags, self.embedding_dim, dtype=dtype).index_put((b, d), holder[row, d])
        return out.to(dtype)

    def _bags_recorded(self, pooling: _Pooling, total: torch.Tensor, sizes: torch.Tensor | None) -> torch.Tensor:
        """``total``, the pooled bags of a lookup in the bags' form, recorded for :meth:`step`
        (:class:`_BagsGradient`), under the marker lock as ``_rows_recorded`` records rows."""
        with self._marker_lock:
            marker, accumulator = self._hooked_marker()
            return _BagsGradient.apply(total, marker, (self._keep_gradient, accumulator, pooling, sizes))

    def _merge_maxima(self, got: list, called: list[int], flat: torch.Tensor, bags: torch.Tensor,
                      keep: torch.Tensor | None, server_of: torch.Tensor, num_bags: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The servers' maxima merged as torch's max pools a bag: its first row, replaced only
        by a strictly greater one. So a tie between servers goes to the row earlier in the bag,
        and a NaN is kept where the bag's first row has it (a later one is never greater).
        ``(values, winner ids)``, ``-1`` where a bag has no row."""
        n, dim = flat.numel(), self.embedding_dim
        kept = torch.arange(n) if keep is None else keep.nonzero().reshape(-1)
        # where each (bag, id) first occurs: the position of a server's winner in its bag
        keys = bags[kept] * self.num_embeddings + flat[kept]
        unique_keys, which = torch.unique(keys, return_inverse=True)
        first_at = torch.full((unique_keys.numel(),), n, dtype=torch.long).scatter_reduce(0, which, kept, "amin")
        bag_of = torch.arange(num_bags).unsqueeze(1).expand(-1, dim)
        value = torch.full((num_bags, dim), float("-inf"))
        winner = torch.full((num_bags, dim), -1, dtype=torch.long)
        at = torch.full((num_bags, dim), n, dtype=torch.long)
        for part, part_winner, _ in got:
            has = part_winner >= 0
            slot = torch.searchsorted(unique_keys, bag_of * self.num_embeddings + part_winner.clamp(min=0))
            part_at = torch.where(has, first_at[slot.clamp(max=unique_keys.numel() - 1)], n)
            better = has & ((winner < 0) | (part > value) | ((part == value) & (part_at < at)))
            value, winner, at = (torch.where(better, part, value), torch.where(better, part_winner, winner),
                                 torch.where(better, part_at, at))
        # each bag's first row, and whether it is NaN (told by the server that holds it)
        start = torch.full((num_bags,), n, dtype=torch.long).scatter_reduce(0, bags[kept], kept, "amin")
        start_server = server_of[start.clamp(max=n - 1)]
        first_nan = torch.zeros(num_bags, dim, dtype=torch.bool)
        for k, (_, _, nan_first) in zip(called, got):
            here = (start < n) & (start_server == k)
            first_nan[here] = nan_first[here]
        value = torch.where(first_nan, float("nan"), value)
        winner = torch.where(first_nan, flat[start.clamp(max=n - 1)].unsqueeze(1).expand(-1, dim), winner)
        return value, winner

    def _pool_here_plan(self, input: torch.Tensor, offsets: torch.Tensor | None,
                        per_sample_weights: torch.Tensor | None,
                        wait_s: float | None = None) -> LookupPlan:
        """Fetch the unique rows and pool them here with torch's ``embedding_bag`` (in two
        halves, as :meth:`_lookup_plan`)."""
        calls, rows_of = self._rows_plan(input, wait_s)  # (checks the ids)
        # torch's own checks of the other arguments, on one zero row, before anything is sent
        # (as the other paths check them): not after a round trip, nor in a collection without
        # the table's name
        with torch.no_grad():
            nn.functional.embedding_bag(torch.zeros(input.shape, dtype=torch.long),
                                        torch.zeros(1, self.embedding_dim, dtype=self._dtype()), offsets,
                                        mode=self.bag_mode, per_sample_weights=per_sample_weights)
        return LookupPlan(calls, partial(self._pool_rows_here, rows_of, input, offsets, per_sample_weights))

    def _pool_rows_here(self, rows_of: Callable[[list], tuple], input: torch.Tensor, offsets: torch.Tensor | None,
                        per_sample_weights: torch.Tensor | None, got: list) -> torch.Tensor:
        """:meth:`_pool_here_plan`'s output of its calls' answers ``got`` (``rows_of``: its rows
        plan's ``finish``)."""
        uniq, inverse, rows = rows_of(got)
        rows, pad = with_padding_row(uniq, rows, self.padding_idx)
        return nn.functional.embedding_bag(
            inverse.reshape(input.shape), rows, offsets, mode=self.bag_mode,
            per_sample_weights=per_sample_weights, padding_idx=pad,
        )
