"""How a server writes a shard file (``_shard_io.write_saved``): around the page cache
(``O_DIRECT``, through an aligned staging buffer) where the filesystem allows it, else through
it; the same bytes, size, checksum and spans either way, and the fallback taken when the
filesystem refuses direct writes at open or at the first write."""

from __future__ import annotations

import errno
import os
import threading
import zlib

import pytest
import torch

from remote_module.ps import _shard_io

#: parts of odd sizes, one larger than the staging buffer (the tail is padded, then cut)
PARTS = [b"\x01" * 4099, torch.arange(1000, dtype=torch.float32),
         torch.randn(_shard_io._STAGE_BYTES // 4 + 12345, generator=torch.Generator().manual_seed(1)), b"tail"]


def _write(tmp_path, name: str, direct: bool, monkeypatch) -> tuple:
    monkeypatch.setattr(_shard_io, "DIRECT_WRITES", direct)
    got = _shard_io.write_saved(str(tmp_path), f"sub/{name}", PARTS)
    return got, (tmp_path / "sub" / name).read_bytes()


def test_a_direct_write_equals_a_buffered_one_byte_for_byte(tmp_path, monkeypatch):
    direct, direct_bytes = _write(tmp_path, "direct", True, monkeypatch)
    buffered, buffered_bytes = _write(tmp_path, "buffered", False, monkeypatch)
    assert direct == buffered and direct_bytes == buffered_bytes
    (size, checksum), spans = direct
    assert size == len(direct_bytes) and size % 4096 != 0  # (the padding was cut off)
    assert checksum == f"crc32:{zlib.crc32(direct_bytes):08x}"
    assert direct_bytes[:4099] == PARTS[0] and direct_bytes[-4:] == b"tail"
    for (offset, length), part in zip(spans[1:3], PARTS[1:3]):
        assert torch.equal(_shard_io.load_file(str(tmp_path / "sub" / "direct"), (offset, length)), part)
    _shard_io.verify(str(tmp_path), _shard_io.FileEntry("sub/direct", size, checksum))


def _assert_written_as_buffered(tmp_path, monkeypatch, write_, refused: list) -> None:
    """A direct write with ``os.write`` as ``write_`` (which refuses it, noting so in
    ``refused``) gives what a buffered write gives; the next file there is not tried direct."""
    monkeypatch.setattr(_shard_io, "_direct_refused", set())
    monkeypatch.setattr(os, "write", write_)
    got, data = _write(tmp_path, "refused", True, monkeypatch)
    assert refused, "the direct write was not refused"
    tried = len(refused)
    again, again_bytes = _write(tmp_path, "again", True, monkeypatch)
    assert len(refused) == tried, "a filesystem that refused a direct write was tried again"
    monkeypatch.undo()
    expected, expected_bytes = _write(tmp_path, "buffered", False, monkeypatch)
    assert got == again == expected and data == again_bytes == expected_bytes


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this OS: every write is buffered")
@pytest.mark.parametrize("refused_at", ["open", "first write"])
def test_a_filesystem_that_refuses_direct_writes_gets_a_buffered_one(tmp_path, monkeypatch, refused_at):
    real_open, real_write, refused = os.open, os.write, []

    def open_(path, flags, *args):
        if flags & os.O_DIRECT and refused_at == "open":
            refused.append(path)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    def write_(fd, data):
        if refused_at == "first write" and not refused:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(os, "open", open_)
    _assert_written_as_buffered(tmp_path, monkeypatch, write_, refused)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_does_not_write_into_its_parents_staging_buffer(tmp_path, monkeypatch):
    # A process that wrote a file keeps its thread's staging buffer; a child forked later (a
    # multiprocessing "fork" start, a DataLoader worker) inherits it. The child's writes must
    # not land in the parent's buffer: here the child writes a whole file while the parent's
    # first buffer is staged and not yet written out.
    _shard_io.write_saved(str(tmp_path), "warm", [b"w"])  # (this thread's buffer made)
    real_write, children, parent = os.write, [], os.getpid()

    def write_(fd, data):
        if not children and os.getpid() == parent:
            pid = os.fork()
            if pid == 0:
                try:
                    _shard_io.write_saved(str(tmp_path), "child", [b"\xbb" * (_shard_io._STAGE_BYTES + 10)])
                finally:
                    os._exit(0)
            children.append(pid)
            assert os.waitpid(pid, 0)[1] == 0
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write_)
    ours = b"\xaa" * (_shard_io._STAGE_BYTES + 10)
    (size, checksum), _ = _shard_io.write_saved(str(tmp_path), "parent", [ours])
    assert children, "no direct write was made"
    assert (tmp_path / "child").read_bytes() == b"\xbb" * (_shard_io._STAGE_BYTES + 10)
    assert (tmp_path / "parent").read_bytes() == ours
    _shard_io.verify(str(tmp_path), _shard_io.FileEntry("parent", size, checksum))


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this OS: every write is buffered")
def test_a_filesystem_that_wants_a_larger_alignment_gets_a_buffered_write(tmp_path, monkeypatch):
    # Direct writes must be aligned to what the filesystem asks (its logical block, or the page
    # size where that is larger than 4 KiB): the whole first buffer is, the tail padded to 4 KiB
    # is not, and is refused with EINVAL after a buffer was written. The file is then written
    # buffered, not the save failed.
    real_write, refused = os.write, []

    def write_(fd, data):
        if memoryview(data).nbytes % (64 << 10):
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    _assert_written_as_buffered(tmp_path, monkeypatch, write_, refused)


def test_a_failed_write_names_its_file(tmp_path, monkeypatch):
    # The trainer writes its own files in the save's call (not through BackgroundWrites, which
    # names what failed): a full disk must say which file it was.
    def write_(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", write_)
    with pytest.raises(OSError, match="No space left") as failed:
        _write(tmp_path, "full", True, monkeypatch)
    assert failed.value.errno == errno.ENOSPC
    assert failed.value.filename == str(tmp_path / "sub" / "full")


def test_no_descriptor_is_left_open_when_the_staging_buffer_cannot_be_made(tmp_path, monkeypatch):
    opened = []
    real_open = os.open

    def open_(path, flags, *args):
        fd = real_open(path, flags, *args)
        opened.append(fd)
        return fd

    def no_memory(*args, **kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(_shard_io.mmap, "mmap", no_memory)
    monkeypatch.setattr(_shard_io, "_stages", threading.local())
    with pytest.raises(OSError, match="Cannot allocate memory"):
        _write(tmp_path, "nomem", True, monkeypatch)
    leaked = []
    for fd in opened:
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(tmp_path / "sub" / "nomem"))
        except OSError:  # (closed, or no file was made)
            continue
        if same:
            leaked.append(fd)
            os.close(fd)
    assert not leaked, "the file's descriptor was left open"


@pytest.mark.parametrize("sizes", [[], [0], [4096], [_shard_io._STAGE_BYTES], [_shard_io._STAGE_BYTES - 1, 1],
                                   [0, 2 * _shard_io._STAGE_BYTES, 0], [_shard_io._STAGE_BYTES + 4096, 4095, 1]],
                         ids=["no parts", "empty", "one page", "one buffer", "a buffer in two", "two buffers",
                              "buffer and pages"])
def test_sizes_on_the_buffers_and_pages_edges_are_written_exactly(tmp_path, monkeypatch, sizes):
    parts = [bytearray(os.urandom(n)) if i % 2 else os.urandom(n) for i, n in enumerate(sizes)]
    got = {}
    for direct in (True, False):
        monkeypatch.setattr(_shard_io, "DIRECT_WRITES", direct)
        written = _shard_io.write_saved(str(tmp_path), f"f{direct}", parts)
        got[direct] = written, (tmp_path / f"f{direct}").read_bytes()
    assert got[True] == got[False]
    assert got[True][1] == b"".join(parts) and got[True][0][0][0] == sum(sizes)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this OS: every write is buffered")
def test_short_direct_writes_are_carried_on(tmp_path, monkeypatch):
    real_write, calls = os.write, []

    def write_(fd, data):  # (at most 64 KiB at a time, as a direct write may stop short on a block)
        calls.append(fd)
        return real_write(fd, memoryview(data)[:64 << 10])

    monkeypatch.setattr(os, "write", write_)
    got, data = _write(tmp_path, "short", True, monkeypatch)
    assert len(calls) > 64
    monkeypatch.setattr(os, "write", real_write)
    assert (got, data) == _write(tmp_path, "buffered", False, monkeypatch)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this OS: every write is buffered")
def test_two_threads_writing_at_once_keep_their_own_bytes(tmp_path, monkeypatch):
    # The background writer thread and an RPC handler (or the trainer) may write at once: both
    # have a buffer staged before either is written out.
    real_write, both_staged = os.write, threading.Barrier(2, timeout=60)
    staged = threading.local()

    def write_(fd, data):
        if not getattr(staged, "waited", False):
            staged.waited = True
            both_staged.wait()
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write_)
    contents = {name: os.urandom(_shard_io._STAGE_BYTES + 5000) for name in ("a", "b")}
    results, failures = {}, []

    def write(name):
        try:
            results[name] = _shard_io.write_saved(str(tmp_path), name, [contents[name]])
        except BaseException as exc:  # (reported by the test's thread)
            failures.append(exc)
            both_staged.abort()

    threads = [threading.Thread(target=write, args=(name,)) for name in contents]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
    for name, data in contents.items():
        assert (tmp_path / name).read_bytes() == data
        (size, checksum), _ = results[name]
        _shard_io.verify(str(tmp_path), _shard_io.FileEntry(name, size, checksum))


def test_a_saved_part_skips_torchs_own_record_crc_and_loads_as_torch_saves_it(tmp_path, monkeypatch):
    # the file's CRC-32 is computed as it is written; torch's own CRC-32 of each zip record was a
    # second pass over the same bytes, and torch.load does not check it
    import io
    import zipfile

    value = {"rows": torch.randn(1000, 4), "ids": torch.arange(1000), "clock": 7}
    ours = io.BytesIO()
    _shard_io.save_into(value, ours)
    theirs = io.BytesIO()
    torch.save(value, theirs)
    from remote_module._core import _torch_private

    if _torch_private._ZIP_WITHOUT_CRC is not None:  # (this torch has the pieces: no record's CRC computed)
        assert all(info.CRC == 0 for info in zipfile.ZipFile(io.BytesIO(ours.getvalue())).infolist())
    assert [i.CRC for i in zipfile.ZipFile(io.BytesIO(theirs.getvalue())).infolist()] != [0] * len(
        zipfile.ZipFile(io.BytesIO(theirs.getvalue())).infolist())
    # the same records otherwise, and the same value loaded (weights_only too)
    assert len(ours.getvalue()) == len(theirs.getvalue())
    for loaded in (torch.load(io.BytesIO(ours.getvalue())), torch.load(io.BytesIO(ours.getvalue()),
                                                                       weights_only=True)):
        assert torch.equal(loaded["rows"], value["rows"]) and torch.equal(loaded["ids"], value["ids"])
        assert loaded["clock"] == 7
    # a torch without the pieces: plain torch.save
    monkeypatch.setattr(_torch_private, "_ZIP_WITHOUT_CRC", None)
    plain = io.BytesIO()
    _shard_io.save_into(value, plain)
    assert plain.getvalue() == theirs.getvalue()


def test_the_crc32_is_zlibs_whichever_implementation_computes_it(tmp_path, monkeypatch):
    # ISA-L's CRC-32 where installed (a dependency on Linux x86_64 and aarch64), zlib's
    # elsewhere: a file written with one is checked with the other
    import platform
    import sys

    if sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64"):
        assert _shard_io.CRC32_BY == "isal"  # (installed with the project here)
    data = [torch.randn(100_003, generator=torch.Generator().manual_seed(3)), b"\x00" * 7, b"odd tail"]
    fast = _shard_io.write_file(str(tmp_path), "fast", data)
    monkeypatch.setattr(_shard_io, "_crc32", zlib.crc32)
    plain = _shard_io.write_file(str(tmp_path), "plain", data)
    assert fast == plain and fast[1] == f"crc32:{zlib.crc32((tmp_path / 'fast').read_bytes()):08x}"
    _shard_io.verify(str(tmp_path), _shard_io.FileEntry("fast", *fast))  # (checked by zlib's)
    monkeypatch.undo()
    _shard_io.verify(str(tmp_path), _shard_io.FileEntry("plain", *plain))
