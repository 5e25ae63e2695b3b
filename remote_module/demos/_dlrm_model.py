"""The DLRM demo's model and data (``remote_module/demos/dlrm.py``): the run's sizes and
settings, the synthetic clicks drawn from a hidden ground truth (:class:`Truth`), the dense
part of the model (:class:`Dense`) and the AUC that scores it."""

from __future__ import annotations

import argparse
from typing import NamedTuple

import torch
from torch import nn

TABLES = {"user": 1_000_000, "ad": 100_000, "site": 10_000}  # rows per table
DIM = 16  # embedding width
DENSE = 8  # dense features per click
BAG = 3  # ids per sparse feature per click
BATCH = 128  # clicks per trainer per step
ZIPF = 1.1  # popularity: the id of rank k is drawn with probability ~ 1 / k**ZIPF
EVAL = 4096  # held-out clicks for the final AUC
PLAIN_PROGRESS_EVERY = 2.0  # seconds between a trainer's progress lines when no bar is shown
WINDOW = 20  # steps in the progressive AUC (each batch scored before it is trained on)
MODES = ("async", "sync", "half_async", "geo")
GEO_PUSH_EVERY = 20  # geo: a trainer pushes its trained rows' deltas every this many steps
# --stream: each table's STREAM_HEAD most popular ids are drawn all run long; its other ids from
# a window of STREAM_WINDOW ids (the same Zipf-like curve over head and window) that slides by
# STREAM_DRIFT ids a step: an id enters at the window's popular end and fades out of its tail
STREAM_HEAD = 64
STREAM_WINDOW = 4096
STREAM_DRIFT = 32
STATS_SAMPLES = 30  # table_stats() samples per run (each a round trip per table per server)
# --admit-after: the admission sketch per table per server (the library's default is 32 MiB):
# about 1e-4 of the ids seen once are admitted early with 100,000 such ids on a server
ADMIT_SKETCH_BYTES = 1 << 20


class Batch(NamedTuple):
    ids: list[torch.Tensor]  # per table: (clicks, BAG) row ids
    dense: torch.Tensor  # (clicks, DENSE)
    clicks: torch.Tensor  # (clicks,) 0. or 1.


class Truth:
    """The hidden ground truth: a weight per table row and a dense weight vector. A click's
    logit is the sum over tables of its ids' mean weight plus the dense features' dot product."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(12345)
        self.rows = [torch.randn(rows, generator=g) for rows in TABLES.values()]
        # popular ids spread over the id space (as hashed ids are), so over every server
        self.ids_by_rank = [torch.randperm(rows, generator=g) for rows in TABLES.values()]
        self.cdf = []
        for rows in TABLES.values():
            p = torch.arange(1, rows + 1, dtype=torch.float64).pow(-ZIPF).cumsum(0)
            self.cdf.append(p / p[-1])
        self.dense = torch.randn(DENSE, generator=g) * 0.2
        p = torch.arange(1, STREAM_HEAD + STREAM_WINDOW + 1, dtype=torch.float64).pow(-ZIPF).cumsum(0)
        self.stream_cdf = p / p[-1]

    def batch(self, gen: torch.Generator, size: int = BATCH, step: int | None = None) -> Batch:
        """``size`` clicks; with ``step``, drawn from that step's stream (see :meth:`stream_ids`)."""
        ids = []
        for by_rank, cdf in zip(self.ids_by_rank, self.cdf):
            u = torch.rand(size * BAG, generator=gen, dtype=torch.float64)
            if step is None:
                rank = torch.searchsorted(cdf, u).clamp_(max=len(cdf) - 1)
            else:
                rank = self.stream_ids(torch.searchsorted(self.stream_cdf, u), step, len(by_rank))
            ids.append(by_rank[rank].view(size, BAG))
        dense = torch.randn(size, DENSE, generator=gen)
        clicks = torch.bernoulli(torch.sigmoid(2.0 * self.logit(ids, dense)), generator=gen)
        return Batch(ids, dense, clicks)

    @staticmethod
    def stream_ids(rank: torch.Tensor, step: int, rows: int) -> torch.Tensor:
        """--stream: the popularity ``rank`` (0: the most popular) of a draw at ``step`` as a
        position in a table's ids by popularity: the head's ranks are themselves; window rank j
        is position ``STREAM_HEAD + (step * STREAM_DRIFT + STREAM_WINDOW - 1 - j) % (rows -
        STREAM_HEAD)``, so a position enters the window as its rank 0 and leaves it
        ``STREAM_WINDOW / STREAM_DRIFT`` steps later (after wrapping round, it comes back)."""
        rank = rank.clamp(max=STREAM_HEAD + STREAM_WINDOW - 1)
        j = rank - STREAM_HEAD
        moved = STREAM_HEAD + (step * STREAM_DRIFT + STREAM_WINDOW - 1 - j) % (rows - STREAM_HEAD)
        return torch.where(j >= 0, moved, rank)

    def logit(self, ids: list[torch.Tensor], dense: torch.Tensor, sparse: bool = True) -> torch.Tensor:
        out = dense @ self.dense
        if sparse:
            out = out + sum(w[i].mean(1) for w, i in zip(self.rows, ids))
        return out


class Dense(nn.Module):
    """Bottom MLP on the dense features, top MLP on [bottom, pooled embeddings]."""

    def __init__(self) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(DENSE, DIM), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(DIM * (len(TABLES) + 1), 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, dense: torch.Tensor, pooled: list[torch.Tensor]) -> torch.Tensor:
        return self.top(torch.cat([self.bottom(dense), *pooled], dim=1)).squeeze(1)


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve: the chance that a random click scores above a random non-click
    (ties count one half); NaN when ``labels`` hold one class only.

    Example::

        >>> auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0., 0., 1., 1.]))
        0.75
    """
    scores = scores.double()
    pos = labels.bool()
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    uniq, inverse, counts = torch.unique(scores, return_inverse=True, return_counts=True)
    # a score's rank is the mean of the ranks its ties share
    mean_rank = counts.cumsum(0).double() - (counts.double() - 1) / 2
    ranks = mean_rank[inverse]
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))



def rows_lifetime(args: argparse.Namespace) -> bool:
    """Whether the run watches its rows' lifetime (--stream, --admit-after > 1 or
    --evict-after-steps): lazy tables, table_stats() samples."""
    return (getattr(args, "stream", False) or getattr(args, "admit_after", 1) > 1
            or getattr(args, "evict_after_steps", None) is not None)



def plural(count: int, word: str) -> str:
    """``"1 trainer"``, ``"2 trainers"``."""
    return f"{count:,} {word}{'' if count == 1 else 's'}"

