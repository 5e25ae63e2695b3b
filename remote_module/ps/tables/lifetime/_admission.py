"""Row admission's counting: a count-min sketch (Cormode and Muthukrishnan 2005) with
conservative update, its counters saturating at the admission threshold and packed 2, 4 or 8
bits each into one byte tensor, so a server's memory for ids seen fewer times than the
threshold is the sketch's fixed size, whatever the number of ids.

An id's estimate is the least of its ``HASHES`` counters. It is never below the number of times
the id was counted (every counter of the id is raised to at least its estimate + 1 each time),
so an id reaches the threshold no later than its true count does; it may reach it earlier when
other ids raised all its counters (a false admission, :func:`false_admission_rate`)."""

from __future__ import annotations

import math

import torch

from remote_module.ps.tables.server._initial import _GAMMA, _shr, mix64

#: counters per id (hash functions)
HASHES = 4
#: default sketch size per table per server, in bytes
DEFAULT_SKETCH_BYTES = 32 << 20
#: the highest threshold the widest counters (8 bits) hold
MAX_THRESHOLD = 255
#: bytes per change-tracking chunk (delta checkpoints send the chunks changed since a baseline)
CHUNK_BYTES = 1 << 8


def counter_bits(threshold: int) -> int:
    """The narrowest counter width (2, 4 or 8 bits) that holds ``threshold``."""
    for bits in (2, 4, 8):
        if threshold < 1 << bits:
            return bits
    raise ValueError(f"admit_after must be at most {MAX_THRESHOLD}, got {threshold}")


def false_admission_rate(sketch_bytes: int, threshold: int, distinct_ids: int) -> float:
    """About how likely an id seen once is admitted at its first count when ``distinct_ids``
    others, each seen once, were counted before it (the chance that each of its counters was
    raised by another id: the Bloom filter bound, which conservative update only lowers); for
    ``threshold`` 2. Higher thresholds need counters raised that many times: far rarer."""
    cells = sketch_bytes * 8 // counter_bits(threshold)
    return (1 - math.exp(-HASHES * distinct_ids / cells)) ** HASHES


class CountingSketch:
    """Counts ids (int64) in ``sketch_bytes`` bytes, up to ``threshold`` each.

    Example::

        sketch = CountingSketch(1 << 20, threshold=2, key=7)
        sketch.count(torch.tensor([3, 9]))   # tensor([1, 1])
        sketch.count(torch.tensor([3]))      # tensor([2])
    """

    def __init__(self, sketch_bytes: int, threshold: int, key: int) -> None:
        self.bits = counter_bits(threshold)
        self.threshold = threshold
        self.per_byte = 8 // self.bits
        self.data = torch.zeros(sketch_bytes, dtype=torch.uint8)
        self.cells = sketch_bytes * self.per_byte
        self.keys = torch.tensor([mix64(torch.tensor([key + j * 0x632BE5AB])).item() for j in range(HASHES)])
        # each chunk's version (the table's change counter when it last changed): for deltas
        self.chunk_version = torch.zeros(-(-sketch_bytes // CHUNK_BYTES), dtype=torch.long)

    def _cells(self, ids: torch.Tensor) -> torch.Tensor:
        """``(HASHES, n)`` counter indices of ``ids``."""
        h = mix64(ids.reshape(1, -1) * _GAMMA ^ self.keys.reshape(-1, 1))
        return _shr(h, 1) % self.cells

    @staticmethod
    def _least(values: torch.Tensor) -> torch.Tensor:
        """Per id (column), the least of its counters' ``values`` (``(HASHES, n)``)."""
        out = values[0]
        for row in values[1:]:
            out = torch.minimum(out, row)
        return out

    def _read(self, cells: torch.Tensor) -> torch.Tensor:
        byte = self.data[cells // self.per_byte].long()
        return byte >> ((cells % self.per_byte) * self.bits) & ((1 << self.bits) - 1)

    def estimate(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's count (at most ``threshold``; never below its true count)."""
        if not ids.numel():
            return torch.zeros(0, dtype=torch.long)
        return self._least(self._read(self._cells(ids)))

    def count(self, ids: torch.Tensor, version: int = 0) -> torch.Tensor:
        """Count ``ids`` (unique) once each; their estimates after. ``version``: the chunks
        changed are marked with it."""
        if not ids.numel():
            return torch.zeros(0, dtype=torch.long)
        cells = self._cells(ids)
        old = self._read(cells)
        # conservative update: raise each of an id's counters to (its least counter + 1) at least,
        # the whole batch at once (two ids sharing a counter: the higher target; never an undercount)
        target = (self._least(old) + 1).clamp_(max=self.threshold)
        uniq, inverse = torch.unique(cells.reshape(-1), return_inverse=True)
        want = torch.zeros(uniq.numel(), dtype=torch.long).scatter_reduce_(
            0, inverse, target.repeat(HASHES), "amax", include_self=False)
        before = torch.zeros(uniq.numel(), dtype=torch.long).scatter_(0, inverse, old.reshape(-1))
        after = torch.maximum(before, want)
        raise_by = after - before
        moved = raise_by > 0
        if bool(moved.any()):
            uniq, raise_by = uniq[moved], raise_by[moved]
            byte = uniq // self.per_byte
            # counters of one byte are disjoint bit fields, none overflowing: their raises add up
            add = raise_by << ((uniq % self.per_byte) * self.bits)
            bytes_, at = torch.unique(byte, return_inverse=True)
            summed = torch.zeros(bytes_.numel(), dtype=torch.long).index_add_(0, at, add)
            self.data[bytes_] = (self.data[bytes_].long() + summed).to(torch.uint8)
            self.chunk_version[torch.unique(bytes_ // CHUNK_BYTES)] = version
        return self._least(after[inverse].reshape(HASHES, -1))

    def nbytes(self) -> int:
        return self.data.numel() + self.chunk_version.numel() * 8

    def changed_since(self, version: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(chunk indices, their bytes)`` of the chunks changed after ``version``."""
        chunks = (self.chunk_version > version).nonzero().reshape(-1)
        if not chunks.numel():
            return chunks, torch.empty(0, dtype=torch.uint8)
        return chunks, self.data[self._bytes_of(chunks)].clone()

    def _bytes_of(self, chunks: torch.Tensor) -> torch.Tensor:
        """The byte positions of ``chunks``, in order (the last chunk may be short)."""
        at = (chunks.long().unsqueeze(1) * CHUNK_BYTES + torch.arange(CHUNK_BYTES)).reshape(-1)
        return at[at < self.data.numel()]

    def set_chunks(self, chunks: torch.Tensor, data: torch.Tensor, version: int) -> None:
        """Overwrite ``chunks`` with ``data`` (:meth:`changed_since`'s)."""
        if not chunks.numel():
            return
        self.data[self._bytes_of(chunks)] = data.to(torch.uint8)
        self.chunk_version[chunks.long()] = version

    def load(self, data: torch.Tensor, version: int) -> None:
        """Take a checkpoint's counters (same size)."""
        self.data.copy_(data.to(torch.uint8))
        self.chunk_version.fill_(version)

    def merge(self, data: torch.Tensor, version: int, chunks: torch.Tensor | None = None) -> None:
        """Raise each counter to at least another sketch's (same size and threshold): the
        sketch of a table whose rows moved here from other servers. Each id's counters stay at
        least its true count, so its estimate does too. ``chunks``: ``data`` holds only these
        chunks (:meth:`changed_since`'s), else the whole sketch."""
        at = torch.arange(self.data.numel()) if chunks is None else self._bytes_of(chunks)
        mask = (1 << self.bits) - 1
        step = 1 << 20
        for start in range(0, at.numel(), step):  # (temporaries of 8 MB)
            where = at[start:start + step]
            mine = self.data[where].long()
            theirs = data[start:start + step].long()
            out = torch.zeros_like(mine)
            for field in range(self.per_byte):
                shift = field * self.bits
                out |= torch.maximum((mine >> shift) & mask, (theirs >> shift) & mask) << shift
            self.data[where] = out.to(torch.uint8)
        self.chunk_version[torch.unique(at // CHUNK_BYTES)] = version
