"""Files a server writes and reads for a shard checkpoint (``remote_module.ps.save_shards`` /
``load_shards``), shared by the table servers (``tables/server/_shard_files.py``) and the dense
servers (``dense/_shard_files.py``): one writer (size and checksum as it writes), one checksum
reader, one check of a file against its manifest entry, the store of loads staged on a
server until every server has checked its files (forgotten if their trainer gave up), and the
writes a server does in the background (one writer thread per process).

A checksum is a tagged string, ``"crc32:<8 hex digits>"`` (zlib's CRC-32, as zip files and
``torch.save``'s records carry: it finds a flipped or truncated file, not a forged one; an RPC
world is one trust domain) or, in checkpoints written before it, ``"sha256:<hex>"``: CRC-32
costs the writing server less than half of SHA-256's CPU, and a save's background writes take
CPU from training on the same cores. It is computed with ISA-L's implementation where the
``isal`` package is installed (a dependency on Linux x86_64 and aarch64: 1.2 against zlib's
14.7 ms per 32 MB on the machine it was measured on), else zlib's: the same values either way,
so a checkpoint written with one is checked with the other.
"""

from __future__ import annotations

import errno
import hashlib
import io
import mmap
import os
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NamedTuple

import torch

from remote_module._core import save_without_record_crc

try:  # ISA-L's CRC-32 (the isal package): zlib's values bit for bit, an order of magnitude faster
    from isal.isal_zlib import crc32 as _crc32

    CRC32_BY = "isal"
except ImportError:  # (a platform without its wheels: zlib's, the same checksums)
    _crc32 = zlib.crc32
    CRC32_BY = "zlib"

#: bytes read at a time while a file's checksum is computed
_READ_BYTES = 1 << 20

#: the checksum files are written with
CHECKSUM = "crc32"
#: the checksums a file is checked with (older checkpoints' SHA-256 among them)
CHECKSUMS = ("crc32", "sha256")


class FileEntry(NamedTuple):
    """One file of a checkpoint as its manifest lists it: ``rel`` (under the checkpoint's
    directory), its size in bytes and its checksum (tagged: ``"crc32:..."``)."""

    rel: str
    size: int
    checksum: str


class Checksum:
    """A running checksum of bytes as they are written or read: ``kind`` one of
    :data:`CHECKSUMS`; :meth:`tagged` is ``"<kind>:<hex>"``."""

    def __init__(self, kind: str = CHECKSUM) -> None:
        if kind not in CHECKSUMS:
            raise ValueError(f"unknown checksum {kind!r} (known: {', '.join(CHECKSUMS)})")
        self.kind = kind
        self._crc = 0
        self._sha = hashlib.sha256() if kind == "sha256" else None

    def update(self, data: Any) -> None:
        if self._sha is not None:
            self._sha.update(data)
        else:  # (both release the GIL while they run over a large buffer, as hashlib does)
            self._crc = _crc32(data, self._crc)

    def tagged(self) -> str:
        return f"{self.kind}:{self._sha.hexdigest() if self._sha is not None else format(self._crc, '08x')}"


def save_bytes(value: Any) -> memoryview:
    """``torch.save(value)``'s bytes."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getbuffer()


class _Sink:
    """A file being written that counts its bytes and checksums them as they go (``torch.save``
    writes into it directly: no copy of a tensor's bytes is made in memory first)."""

    def __init__(self, f: Any) -> None:
        self.f, self.digest, self.size = f, Checksum(), 0
        self.error: BaseException | None = None  # (what a write raised: torch.save reports only its own error)

    def write(self, data: Any) -> int:
        try:
            self.f.write(data)
        except BaseException as exc:
            self.error = exc
            raise
        self.digest.update(data)
        size = memoryview(data).nbytes
        self.size += size
        return size

    def flush(self) -> None:
        pass


#: write shard files around the page cache (``O_DIRECT``) where the filesystem allows it
DIRECT_WRITES = True
#: the staging buffer of a direct write (one per writing thread, kept), and its alignment
_STAGE_BYTES = 4 << 20
_ALIGN = 4096
_stages = threading.local()


class _DirectFile:
    """A file written around the page cache (``O_DIRECT``), through a page-aligned staging
    buffer written out a whole buffer at a time: the tail padded to the alignment, then the file
    cut to its size. A checkpoint's large files are written once and read at a resume, if ever:
    through the page cache, each costs the writing server page allocation, dirty tracking and
    writeback besides the copy, and where the cache is full, reclaim (measured here on ext4: 130
    to 270 ms of system CPU per 35 MB file written and fsynced, against under 10 ms direct).
    ``OSError`` (``EINVAL``) at open or at a write where the filesystem refuses it (the padded
    tail's, where it wants writes aligned to more than 4 KiB)."""

    def __init__(self, path: str) -> None:
        stage = getattr(_stages, "buffer", None)
        if stage is None:  # (page-aligned; private: a process forked later gets its own copy, not this memory)
            stage = _stages.buffer = mmap.mmap(-1, _STAGE_BYTES, flags=mmap.MAP_PRIVATE)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o666)
        self.view, self.used, self.size = memoryview(stage), 0, 0

    def write(self, data: Any) -> None:
        data = memoryview(data).cast("B")
        while data.nbytes:
            n = min(data.nbytes, _STAGE_BYTES - self.used)
            self.view[self.used:self.used + n] = data[:n]
            self.used += n
            data = data[n:]
            if self.used == _STAGE_BYTES:
                self._out(_STAGE_BYTES)

    def _out(self, length: int) -> None:
        done = 0
        while done < length:  # (a short write of an O_DIRECT file ends on an aligned boundary)
            wrote = os.write(self.fd, self.view[done:length])
            if wrote <= 0:  # (not for a regular file; never loop on it)
                raise OSError(errno.EIO, "a direct write wrote nothing")
            done += wrote
        self.size += self.used
        self.used = 0

    def finish(self) -> None:
        """The tail written, the file cut to its size and flushed to disk."""
        if self.used:
            tail = self.used
            padded = -(-tail // _ALIGN) * _ALIGN
            self.view[tail:padded] = bytes(padded - tail)
            self._out(padded)
        os.ftruncate(self.fd, self.size)
        os.fsync(self.fd)

    def close(self) -> None:
        try:
            self.view.release()
        finally:
            os.close(self.fd)


def write_file(directory: str, rel: str, parts: list[Any]) -> tuple[int, str]:
    """Write ``parts`` one after another to ``directory/rel`` (flushed to disk): its size and
    checksum (tagged). A part is bytes, or anything else, which ``torch.save`` writes."""
    return write_saved(directory, rel, parts)[0]


def write_saved(directory: str, rel: str, parts: list[Any]) -> tuple[tuple[int, str], list[tuple[int, int]]]:
    """:func:`write_file`, and where each part lies in the file (``(offset, length)``). Written
    around the page cache where the filesystem allows it (:class:`_DirectFile`), else through it."""
    target = os.path.join(directory, rel)
    try:
        return _write_target(target, parts)
    except OSError as exc:  # (named: the trainer writes its own files in the save's call)
        if exc.filename is None and exc.errno is not None:
            raise OSError(exc.errno, exc.strerror, target) from exc
        raise


#: the filesystems (``st_dev``) that refused a direct write here: written through the page cache
#: from then on, not tried (and, where the refusal came late, written twice) for every file
_direct_refused: set[int] = set()


def _write_target(target: str, parts: list[Any]) -> tuple[tuple[int, str], list[tuple[int, int]]]:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    device = os.stat(os.path.dirname(target)).st_dev
    if DIRECT_WRITES and hasattr(os, "O_DIRECT") and device not in _direct_refused:
        try:
            direct = _DirectFile(target)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            _direct_refused.add(device)
        else:
            try:
                return _write_parts(direct, parts, direct.finish)
            except OSError as exc:  # (a filesystem that takes the flag at open and refuses a write,
                if exc.errno != errno.EINVAL:  # the first or a later one: all of it written buffered)
                    raise
                _direct_refused.add(device)
            finally:
                direct.close()
    with open(target, "wb") as f:
        return _write_parts(f, parts, lambda: (f.flush(), os.fsync(f.fileno())))


def save_into(value: Any, f: Any) -> None:
    """``torch.save(value, f)``, without the CRC-32 torch computes of each record (zip's), where
    this torch allows: a file written here is checksummed whole as it is written (:class:`_Sink`),
    and torch's pass over the same bytes doubled a writing server's CPU (torch.load does not
    check it; ``torch.serialization.set_crc32_options(False)`` does the same, for every save in
    the process). Elsewhere, plain ``torch.save``."""
    if not save_without_record_crc(value, f):
        torch.save(value, f)


def _write_parts(f: Any, parts: list[Any], finish: Callable[[], Any]) -> tuple[tuple[int, str], list[tuple[int, int]]]:
    sink = _Sink(f)
    spans = []
    for part in parts:
        before = sink.size
        if isinstance(part, (bytes, bytearray, memoryview)):
            sink.write(part)
        else:
            try:
                save_into(part, sink)
            except RuntimeError:
                if sink.error is not None:  # (the file's own error, e.g. a full disk, not torch's "unexpected pos")
                    raise sink.error from None
                raise
        spans.append((before, sink.size - before))
    finish()
    return (sink.size, sink.digest.tagged()), spans


def file_checksum(path: str | os.PathLike, kind: str = CHECKSUM) -> str:
    """The checksum (tagged) of the file at ``path``, read through once, a block at a time."""
    digest = Checksum(kind)
    with open(path, "rb") as f:
        while part := f.read(_READ_BYTES):
            digest.update(part)
    return digest.tagged()


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 (hex) of the file at ``path``, read through once, a block at a time."""
    return file_checksum(path, "sha256").split(":", 1)[1]


def verify(directory: str, entry: FileEntry) -> None:
    """``ValueError`` naming the checkpoint's file ``entry`` unless it has the size and checksum
    the manifest records (read through once, a block at a time)."""
    path = os.path.join(directory, entry.rel)
    try:
        size = os.path.getsize(path)
    except OSError as exc:
        raise ValueError(f"{path}: missing or unreadable ({exc.strerror or exc})") from None
    if size != entry.size:
        raise ValueError(f"{path}: {size} bytes, the manifest says {entry.size} (truncated or overwritten)")
    kind = entry.checksum.split(":", 1)[0]
    if kind not in CHECKSUMS:
        raise ValueError(f"{path}: the manifest gives it a checksum of unknown kind, {entry.checksum!r}")
    got = file_checksum(path, kind)
    if got != entry.checksum:
        raise ValueError(f"{path}: its checksum is {got}, the manifest says {entry.checksum} (corrupt)")


def load_file(path: str, at: tuple[int, int] | None = None) -> Any:
    """What a checked file holds (memory-mapped: only what is used is read), or the tensor
    saved at ``at`` (``(offset, length)``) in it."""
    if at is None:
        return torch.load(path, mmap=True, weights_only=True)
    with open(path, "rb") as f:
        f.seek(at[0])
        return torch.load(io.BytesIO(f.read(at[1])), weights_only=True)


class StagedLoads:
    """What a server read and checked for loads under way, by ``(object, load)`` (two trainers
    may load one object at once), until the load is applied or dropped. A load kept longer than
    ``keep_timeouts`` times its trainer's timeout (the trainer gave up or died) is forgotten at
    a later :meth:`put` on this server."""

    def __init__(self, keep_timeouts: float = 3) -> None:
        self.keep_timeouts = keep_timeouts
        self.lock = threading.Lock()
        self.staged: dict[tuple[str, str], Any] = {}
        self.expires: dict[tuple[str, str], float | None] = {}  # time.monotonic(); None: never

    def forget_expired(self) -> None:
        now = time.monotonic()
        with self.lock:
            for load in [load for load, at in self.expires.items() if at is not None and at < now]:
                self.staged.pop(load, None)
                del self.expires[load]

    def put(self, load: tuple[str, str], value: Any, timeout: float | None) -> None:
        with self.lock:
            self.staged[load] = value
            self.expires[load] = None if not timeout else time.monotonic() + self.keep_timeouts * timeout

    def pop(self, load: tuple[str, str]) -> Any:
        """The staged value (None: none, or forgotten), no longer kept."""
        with self.lock:
            self.expires.pop(load, None)
            return self.staged.pop(load, None)


class SnapshotMemory:
    """Memory a server copies its snapshots into, kept from one save to the next: a copy into
    memory touched before is a memcpy, while a copy into fresh memory costs as much again in page
    faults (36 MB here: 2.2 against 17 ms), on the trainer's wait and on the server's CPU. A save
    that asks to keep it (``keep_s`` seconds: the ``Checkpointer``'s, which saves again) gets
    its copies back after they are written; one not taken again within ``keep_s`` is freed. So
    while a job saves every few minutes, a server holds one snapshot's worth of memory more (what
    it holds anyway while a save is written); :meth:`forget` frees it when the job saves no more
    (the ``Checkpointer``'s ``close()``). ``keep_s`` 0 (``save_shards``): nothing kept after the
    write (memory a job kept is taken, not held beside a fresh copy).

    Memory kept with a ``stamp`` (what it held: a table's rows as of a version) is brought up to
    date by copying only the rows changed since (``copy(changed_since=...)``), where they are few:
    a job whose saves are minutes apart touches a small part of its tables between them."""

    #: rows changed since the kept copy, as a part of all, above which the whole is copied again
    #: (an index copy of a row costs several times a memcpy of it)
    PARTIAL_AT_MOST = 0.25

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (memory, the timer that frees it, that keep's token: a timer firing late frees nothing
        # kept since, and what the memory holds: its stamp, or None)
        self._kept: dict[tuple, tuple[torch.Tensor, threading.Timer, object, Any]] = {}
        #: copies into kept memory so far: of the rows changed only, or whole
        self.copied = {"partial": 0, "whole": 0}

    def copy(self, key: tuple, source: torch.Tensor, keep_s: float,
             changed_since: Callable[[Any], torch.Tensor | None] | None = None) -> torch.Tensor:
        """A copy of ``source`` (contiguous), in the memory kept under ``key`` if it fits (taken
        whatever ``keep_s``: a save that keeps nothing, beside a job that keeps, would otherwise
        hold a third copy of the rows while it writes). ``changed_since(stamp)``: the indices of
        the rows of ``source`` changed since the kept memory's ``stamp`` (None: not known); only
        those are copied, where they are few (:attr:`PARTIAL_AT_MOST`)."""
        with self._lock:
            kept = self._kept.pop(key, None)
        if kept is not None:
            kept[1].cancel()  # (one timer per kept memory: a job saving every second starts no pile of them)
        elif keep_s <= 0:
            return source.clone(memory_format=torch.contiguous_format)
        fits = kept is not None and kept[0].shape == source.shape and kept[0].dtype == source.dtype
        out = kept[0] if fits else torch.empty(source.shape, dtype=source.dtype)
        if fits and changed_since is not None and kept[3] is not None:
            rows = changed_since(kept[3])
            if rows is not None and rows.numel() <= self.PARTIAL_AT_MOST * max(1, source.shape[0]):
                self.copied["partial"] += 1
                return out.index_copy_(0, rows, source.index_select(0, rows))
        self.copied["whole"] += 1
        return out.copy_(source)

    def keep(self, key: tuple, memory: torch.Tensor, keep_s: float, stamp: Any = None) -> threading.Timer | None:
        """``memory`` (a copy written and no longer used) kept under ``key`` for the next
        :meth:`copy`, or freed after ``keep_s`` seconds (by the timer returned); ``stamp``: what
        it holds (for the next copy's ``changed_since``; None: unknown, copied whole). None
        (nothing kept) where no timer can start: keeping only spares the next copy its page
        faults, and it runs as a server's write completes, which must not fail for it."""
        if keep_s <= 0:
            return None
        token = object()
        timer: threading.Timer | None = threading.Timer(keep_s, self._expire, (key, token))
        timer.daemon = True
        try:
            timer.start()
        except RuntimeError:  # (the process's threads at their limit)
            timer = None
        with self._lock:
            replaced = self._kept.pop(key, None)
            if timer is not None:
                self._kept[key] = (memory, timer, token, stamp)
        if replaced is not None:
            replaced[1].cancel()
        return timer

    def _expire(self, key: tuple, token: object) -> None:
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None and kept[2] is token:
                del self._kept[key]

    def forget(self, match: Callable[[tuple], bool]) -> int:
        """Free the memory kept under the keys ``match`` accepts now; its bytes."""
        with self._lock:
            gone = [self._kept.pop(key) for key in [k for k in self._kept if match(k)]]
        for _, timer, _, _ in gone:
            timer.cancel()
        return sum(m.untyped_storage().nbytes() for m, *_ in gone)

    def held_bytes(self, match: Callable[[tuple], bool] = lambda key: True) -> int:
        """Bytes of memory kept now (under the keys ``match`` accepts)."""
        with self._lock:
            return sum(m.untyped_storage().nbytes() for key, (m, *_) in self._kept.items() if match(key))


class BackgroundWrites:
    """The files a server writes after it answered (a save's snapshot, written while training
    goes on): on one writer thread per process, in the order begun, each write's outcome kept by
    its key until asked for (:meth:`outcome`). An outcome nobody asks for (its trainer died) is
    forgotten ``keep_s`` seconds after it was written, at a later :meth:`begin`."""

    def __init__(self, keep_s: float = 3600.0) -> None:
        self.keep_s = keep_s
        self._lock = threading.Lock()
        self._outcomes: dict[tuple, tuple[torch.futures.Future, float]] = {}  # (outcome, when done; inf: not yet)
        self._writer: ThreadPoolExecutor | None = None

    def begun(self, key: tuple) -> bool:
        with self._lock:
            return key in self._outcomes

    def begin(self, key: tuple, write: Callable[[], Any], what: str) -> None:
        """Run ``write()`` on the writer thread; its result (or its failure, as an ``OSError``
        saying ``what`` failed) is the outcome of ``key``."""
        outcome: torch.futures.Future = torch.futures.Future()
        with self._lock:
            if key in self._outcomes:
                raise ValueError(f"{what}: begun here already")
            now = time.monotonic()
            for old in [k for k, (f, at) in self._outcomes.items() if f.done() and at + self.keep_s < now]:
                del self._outcomes[old]
            self._outcomes[key] = (outcome, float("inf"))
            if self._writer is None:
                self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="remote_module-shard-writer")
            self._writer.submit(self._run, key, write, what, outcome)

    def _run(self, key: tuple, write: Callable[[], Any], what: str, outcome: torch.futures.Future) -> None:
        try:
            result = write()
        except Exception as exc:  # (a full disk, a directory gone: the trainer's save fails, naming it)
            self._done(key, outcome)
            outcome.set_exception(OSError(f"{what} failed: {type(exc).__name__}: {exc}"))
            return
        self._done(key, outcome)
        outcome.set_result(result)

    def _done(self, key: tuple, outcome: torch.futures.Future) -> None:
        with self._lock:
            if key in self._outcomes:
                self._outcomes[key] = (outcome, time.monotonic())

    def outcome(self, key: tuple, what: str) -> torch.futures.Future:
        """The outcome of ``key`` (a Future: set once written), no longer kept here; a failed
        Future (``LookupError``) if none was begun (the server restarted since, or it was asked
        for already)."""
        with self._lock:
            got = self._outcomes.pop(key, None)
        if got is not None:
            return got[0]
        failed: torch.futures.Future = torch.futures.Future()
        failed.set_exception(LookupError(f"{what}: no such save was begun on this server (it restarted since, or "
                                         "the outcome was asked for already)"))
        return failed


#: this process's background writes (table servers' and dense servers')
writes = BackgroundWrites()
#: the memory this process's snapshots are copied into
snapshots = SnapshotMemory()
