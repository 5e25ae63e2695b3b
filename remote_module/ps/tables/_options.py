"""The arguments only a table takes (its sizes, rows and lifetime), checked once, here; the
ones it shares with a PSModel are ``ps._options``'."""

from __future__ import annotations

from dataclasses import InitVar, dataclass

from remote_module._core import positive_int
from remote_module.ps._placement import _index
from remote_module.ps.tables.lifetime._admission import DEFAULT_SKETCH_BYTES, counter_bits


@dataclass(frozen=True)
class TableOptions:
    """A table's own arguments, checked when built (``ValueError`` or ``TypeError`` naming the
    argument): sizes as ``nn.Embedding`` takes them (any integer ``operator.index`` accepts,
    numpy.int64...), ``padding_idx`` made non-negative, and the lifetime settings checked
    against ``init`` and the table's ``ps_mode`` (an InitVar: a geo table's rows train on the
    trainers, so the servers neither admit nor evict them).

    Example::

        >>> TableOptions(1000, 16, padding_idx=-1, ps_mode="async").padding_idx
        999
    """

    num_embeddings: int
    embedding_dim: int
    init: str = "eager"
    min_block_size: int = 8192
    seed: int = 0
    sparse: bool = False
    padding_idx: int | None = None
    admit_after: int = 1
    admit_sketch_bytes: int = DEFAULT_SKETCH_BYTES
    evict_after_steps: int | None = None
    ps_mode: InitVar[str] = "async"

    def __post_init__(self, ps_mode: str) -> None:
        num_embeddings = positive_int(self.num_embeddings, "num_embeddings")
        checked = {"num_embeddings": num_embeddings, "embedding_dim": positive_int(self.embedding_dim, "embedding_dim")}
        if self.init not in ("eager", "lazy"):
            raise ValueError(f"init must be 'eager' or 'lazy', got {self.init!r}")
        checked["min_block_size"] = positive_int(self.min_block_size, "min_block_size")
        checked["seed"] = seed = _index(self.seed, "seed")
        if seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        if not isinstance(self.sparse, bool):
            raise TypeError(f"sparse must be a bool, as torch's, got {self.sparse!r}")
        checked["padding_idx"] = self._padding_idx(num_embeddings)
        checked.update(self._lifetime(ps_mode))
        for key, value in checked.items():  # (frozen: set once, here)
            object.__setattr__(self, key, value)

    def _padding_idx(self, num_embeddings: int) -> int | None:
        """``padding_idx`` checked, as an index in ``[0, num_embeddings)`` (or None)."""
        if self.padding_idx is None:
            return None
        padding_idx = _index(self.padding_idx, "padding_idx")
        if not -num_embeddings <= padding_idx < num_embeddings:
            raise ValueError(f"padding_idx must be within num_embeddings: in [-{num_embeddings}, "
                             f"{num_embeddings}), got {padding_idx}")
        return padding_idx % num_embeddings

    def _lifetime(self, ps_mode: str) -> dict:
        """``admit_after``, ``admit_sketch_bytes`` and ``evict_after_steps``, checked."""
        admit_after = positive_int(self.admit_after, "admit_after", message="admit_after must be a positive int "
                                   "(the steps an id is counted in before its row is stored), got {value!r}")
        sketch_bytes = positive_int(self.admit_sketch_bytes, "admit_sketch_bytes")
        if admit_after > 1:
            if self.init != "lazy":
                raise ValueError(f"admit_after={admit_after} needs init='lazy' (an eager table stores every row "
                                 f"from the start), got init={self.init!r}")
            counter_bits(admit_after)  # (ValueError above the widest counters' limit)
        evict = self.evict_after_steps
        if evict is not None:
            evict = positive_int(evict, "evict_after_steps", message=(
                "evict_after_steps must be None (never evict) or a positive int, got {value!r}"))
        if ps_mode == "geo" and (admit_after > 1 or evict is not None):
            raise ValueError(f"admit_after={admit_after} and evict_after_steps={evict!r} need a mode in "
                             "which the servers step the rows (sync, async, half_async); geo trainers train rows "
                             "locally and push deltas: leave them at 1 and None")
        return {"admit_after": admit_after, "admit_sketch_bytes": sketch_bytes, "evict_after_steps": evict}
