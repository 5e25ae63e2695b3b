"""What a trainer's calls to the table servers carry: each handler's arguments as a named tuple
(the handler still takes them positionally, ``handler(*request)``), so that the trainer's side
reads and rewrites them by name (the step a lookup reads at its sending, the pushes several
tables send packed, the traffic a collection counts), never by position."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


class RowsRead(NamedTuple):
    """``_handlers._rows_for`` / ``_rows_now``: the rows of ``ids`` (pooled into bags with
    ``pool``), read at ``step``; ``seconds``: how long a sync read may wait for it; ``seen``: the
    table's refused steps this trainer was told of (sync)."""

    name: str
    ids: torch.Tensor
    step: int = 0
    pool: tuple | None = None
    seconds: float = math.inf
    seen: int | None = None


class BagsRead(NamedTuple):
    """``_handlers._bags_when_applied`` / ``_bags_now``: a bag lookup of a table one server
    holds whole, its arguments as ``nn.EmbeddingBag`` takes them; ``step``, ``seconds``,
    ``seen`` as :class:`RowsRead`'s."""

    name: str
    input: torch.Tensor
    offsets: torch.Tensor | None
    weights: torch.Tensor | None
    mode: str
    step: int = 0
    seconds: float = math.inf
    seen: int | None = None


class PooledRead(NamedTuple):
    """``_handlers._pool_tables``: several tables' sum-pooled lookups in one call (a
    collection's, ``tables/_packed.py``): each table's step and, in sync mode, its count of
    refused steps this trainer was told of (``seen``)."""

    names: list
    steps: list
    ids: torch.Tensor
    first: torch.Tensor
    bag_base: list
    bag_counts: list
    seconds: float = math.inf
    seen: list | None = None


class RowsPush(NamedTuple):
    """``_handlers._push_rows``: one table's push of a step (``ids``, ``grad`` None: a sync step
    without a gradient) by ``trainer``'s object ``token``."""

    name: str
    trainer: str
    step: int
    ids: torch.Tensor | None
    grad: torch.Tensor | None
    token: str | None = None


class BagsPush(NamedTuple):
    """``_handlers._push_bags``: one table's push of a step as the gradient of the pooled bags
    of its lookup (the trainer's ``_BagsGradient``): ``ids`` as that lookup sent them to this
    server, ``first`` each bag's first position among them (as sent), ``grads`` every bag's
    gradient (divided by its size for a mean); the server computes the rows' gradients."""

    name: str
    trainer: str
    step: int
    ids: torch.Tensor
    first: torch.Tensor
    grads: torch.Tensor
    token: str | None = None


class PackedEntry(NamedTuple):
    """A table's push among several in one ``_push_tables`` call: its ``rows`` ids and gradient
    rows are the next ones of the call's packed tensors."""

    name: str
    trainer: str
    step: int
    rows: int
    token: str | None


class TablesPush(NamedTuple):
    """``_handlers._push_tables``: several tables' :class:`RowsPush` packed (``entries``: a
    :class:`PackedEntry` each, their ids and gradient rows in ``ids`` and ``grads``)."""

    entries: list
    ids: torch.Tensor
    grads: torch.Tensor


class BagEntry(NamedTuple):
    """A table's push among several in one ``_push_bag_tables`` call: its ids are the call's
    ``ids[lo:hi]``."""

    name: str
    trainer: str
    step: int
    lo: int
    hi: int
    token: str | None


class BagTablesPush(NamedTuple):
    """``_handlers._push_bag_tables``: the pushes of tables looked up together, from the
    gradient of their pooled bags (``entries``: a :class:`BagEntry` each)."""

    entries: list
    ids: torch.Tensor | None
    first: torch.Tensor | None
    grads: torch.Tensor


class RowDeltasPush(NamedTuple):
    """``_handlers._push_row_deltas``: geo's push of rows' deltas."""

    name: str
    ids: torch.Tensor
    deltas: torch.Tensor


class UnlessMerged(NamedTuple):
    """``_handlers._read_unless_merged``: a prefetched lookup's check at its forward
    (half_async): ``handler(*read)`` again where a table of ``merged`` (``(name, merges read
    with the prefetch)`` each) merged since."""

    merged: list
    handler: object
    read: tuple
