"""A shard checkpoint's manifest and its ``torch.distributed.checkpoint`` metadata: what the
trainer writes (small, last, atomically) and reads back first. Pure file and dict logic; no RPC.

The manifest, ``manifest.json``, lists every file of the checkpoint with its size and checksum
(``"files"``), the objects saved (``"objects"``: a table, or a collection's or a PSModel's
table names), by state_dict-style key (``"emb"``, ``"ebc.a"``) each table's settings and each
saving server's part of it (``"tables"``), and by name each PSModel's parameters, blocks and
their servers and files, and optimizer (``"models"``). A directory without it is a save that
did not complete (torn).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from remote_module._core import dcp_storage_info

MANIFEST = "manifest.json"
#: what a manifest's ``"format"`` says (a directory of something else is refused)
FORMAT = "remote_module.ps shards"
VERSION = 2
#: the manifest versions this build reads (1: files' checksums are SHA-256, under "sha256")
READS_VERSIONS = (1, 2)
#: ``torch.distributed.checkpoint``'s metadata file name (its ``filesystem._metadata_fn``)
DCP_METADATA = ".metadata"
#: the id of the save under way into a directory (a later save into it refuses the earlier one's manifest)
SAVE_ID = ".save-id"
LAYOUTS = ("shared", "local")


class CheckpointError(ValueError):
    """A shard checkpoint that cannot be loaded: torn (no manifest: the save did not complete),
    a file missing, truncated or corrupt (its size or checksum differs from the manifest's), or
    saved in a layout these servers cannot read. The message names the file and why; nothing
    was loaded."""


def write_atomically(path: str, data: bytes, durable: bool = True) -> None:
    """``data`` at ``path``, all or nothing: written to a temporary file beside it, flushed to
    disk, renamed over ``path`` (``os.replace``), and the rename flushed (the directory). Not
    ``durable``: neither flushed (a marker that matters only while its writer runs)."""
    directory = os.path.dirname(os.path.abspath(path))
    # (a unique name created as open() creates files, with the umask's permissions: mkstemp's
    # 0600 would keep another user who reads the shard files from reading the manifest)
    temporary = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
    if durable:
        sync_directory(directory)


def sync_directory(directory: str) -> None:
    """Flush a directory's entries (a rename, a removal) to disk, where the OS allows it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


#: the manifest's own checksum: the sha256 of its JSON text without this key (sorted keys)
SELF_SHA256 = "manifest_sha256"


def _body_sha256(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != SELF_SHA256}
    return hashlib.sha256(json.dumps(body, indent=1, sort_keys=True).encode()).hexdigest()


def write_manifest(directory: str, manifest: dict) -> dict:
    """Write ``manifest`` as the checkpoint's ``manifest.json`` (last, atomically), with the
    sha256 of its own text (a manifest damaged on disk is refused, as a shard file is); the
    manifest as a load reads it back (JSON: tuples are lists)."""
    manifest = json.loads(json.dumps(manifest, indent=1, sort_keys=True))
    text = json.dumps({**manifest, SELF_SHA256: _body_sha256(manifest)}, indent=1, sort_keys=True)
    write_atomically(os.path.join(directory, MANIFEST), text.encode())
    return json.loads(text)


def read_manifest(directory: str) -> dict:
    """The manifest of the checkpoint in ``directory``; :class:`CheckpointError` for none (a
    torn save) or one that is not a shard checkpoint's."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} does not exist: {directory!r} holds no complete shard checkpoint (a save "
                              "that did not finish is torn and never loaded); load an earlier checkpoint")
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not readable as a manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a manifest of remote_module.ps.save_shards (format "
                              f"{manifest.get('format') if isinstance(manifest, dict) else None!r})")
    if manifest.get("version") not in READS_VERSIONS:
        raise CheckpointError(f"{path}: manifest version {manifest.get('version')!r}, this build reads versions "
                              f"{', '.join(map(str, READS_VERSIONS))}")
    if manifest.get(SELF_SHA256) != _body_sha256(manifest):
        raise CheckpointError(f"{path}: its text does not match its own sha256 (corrupt or edited by hand)")
    return manifest


def read_chain(directory: str, manifest: dict) -> list[tuple[str, dict]]:
    """The checkpoints a load of ``directory`` (whose manifest is ``manifest``) reads, oldest
    first: itself, and where it is an incremental save its base, the base's base, and so on to
    a full checkpoint (``"base"``: its path relative to the save, and its manifest's sha256 as
    it was then). :class:`CheckpointError` naming the missing link when one is gone, torn,
    saved again since, or in another layout."""
    links = [(directory, manifest)]
    while links[0][1].get("base") is not None:
        here, mine = links[0]
        base = mine["base"]
        path = os.path.normpath(os.path.join(here, base["path"]))
        why = f"{here} is an incremental save on {path}, which must stay as it was saved for it to load"
        if path in (d for d, _ in links):
            raise CheckpointError(f"{why}: it is a save of the chain already (the manifest was edited)")
        try:
            theirs = read_manifest(path)
        except CheckpointError as exc:
            raise CheckpointError(f"{why}, but it does not load: {exc}") from None
        if theirs.get(SELF_SHA256) != base.get("manifest_sha256"):
            raise CheckpointError(f"{why}, but it was saved again since (its manifest differs): load a checkpoint "
                                  "saved after it instead")
        if theirs.get("layout") != mine.get("layout"):
            raise CheckpointError(f"{why}, but it is in the {theirs.get('layout')!r} layout, not "
                                  f"{mine.get('layout')!r} (the manifest was edited)")
        links.insert(0, (path, theirs))
    return links


def dcp_metadata(weights: dict[str, tuple[tuple[int, int], list[tuple[str, int, int, int, int]]]]) -> bytes:
    """A ``torch.distributed.checkpoint`` ``.metadata`` file (pickled ``Metadata``) for eager
    tables' weights: ``{key: ((rows, dim), [(file, first row, rows, offset, length)])}``, each
    chunk one ``torch.save`` of rows ``first .. first + rows`` at ``offset`` in ``file``."""
    tensors, storage = {}, {}
    for key, ((rows, dim), chunks) in weights.items():
        listed = []
        for rel, first, count, offset, length in sorted(chunks, key=lambda c: c[1]):
            at = torch.Size([first, 0])
            listed.append(ChunkStorageMetadata(offsets=at, sizes=torch.Size([count, dim])))
            storage[MetadataIndex(key, at)] = dcp_storage_info(rel, offset, length)
        tensors[key] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([rows, dim]), listed)
    return pickle.dumps(Metadata(state_dict_metadata=tensors, storage_data=storage))


def file_record(size: int, checksum: str, server: str | None) -> dict[str, Any]:
    """How the manifest lists a file of ``size`` bytes with ``checksum`` (tagged: ``"crc32:..."``)
    that ``server`` wrote (None: the trainer)."""
    return {"bytes": size, "checksum": checksum, "server": server}


def file_entry(files: dict, rel: str) -> tuple[str, int, str]:
    """``(rel, size, checksum)`` of a file the manifest lists, its checksum tagged (a version 1
    manifest's ``sha256`` as ``"sha256:<hex>"``); CheckpointError if it lists none."""
    entry = files.get(rel)
    if not isinstance(entry, dict):
        raise CheckpointError(f"the manifest lists no file {rel!r}: the checkpoint is incomplete")
    if os.path.isabs(rel) or ".." in rel.replace("\\", "/").split("/"):
        raise CheckpointError(f"the manifest lists a file outside its directory, {rel!r}: it was edited")
    if "checksum" in entry:
        checksum = entry["checksum"]
    elif "sha256" in entry:
        checksum = f"sha256:{entry['sha256']}"
    else:
        raise CheckpointError(f"the manifest lists the file {rel!r} with no checksum: it was edited, or written by "
                              "a build that wrote no checksum")
    return rel, int(entry["bytes"]), str(checksum)


def overlaps(blocks: list, ranges: list) -> bool:
    """Whether any row block ``(first, count)`` of ``blocks`` meets one of ``ranges``."""
    return any(max(f, g) < min(f + c, g + d) for f, c in blocks for g, d in ranges)


def table_entry(table: Any) -> dict[str, Any]:
    """The settings of ``table`` (a ShardedEmbedding) a manifest keeps: what a load checks."""
    return {"name": table.name, "init": table.init, "num_embeddings": table.num_embeddings,
            "embedding_dim": table.embedding_dim, "optimizer": table._row_opt.kind, "ps_mode": table.ps_mode,
            "admission_bits": table._admission_bits(), "admit_sketch_bytes": table.admit_sketch_bytes
            if table.admit_after > 1 else None, "evicting": table.evict_after_steps is not None}
