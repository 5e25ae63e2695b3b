"""The files of a whole-job checkpoint (:mod:`._checkpointer`): the directory layout, writing
a file whole or not at all, and what makes a complete checkpoint loadable (its manifest, every
file it lists at its size and checksum, and the servers' shard files ``ps/manifest.json``
lists)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from remote_module.ps._shard_io import file_sha256, save_bytes
from remote_module.ps.checkpoint._manifest import MANIFEST as PS_MANIFEST
from remote_module.ps.checkpoint._manifest import CheckpointError, read_manifest

#: a complete checkpoint's directory name, and a staging one's
STEP_DIR = "step-{:08d}"
_COMPLETE = re.compile(r"^step-(\d{8})$")
_STAGING = re.compile(r"^\.step-(\d{8})\.tmp$")
MANIFEST = "manifest.json"
#: the servers' tables and collections: a save_shards checkpoint (shared layout) in this subfolder
PS_DIR = "ps"
#: the servers' PSModels, as the trainer gathers them (state_dict)
PS_FILE = "ps.pt"
#: the format of the manifest (a checkpoint of another format is refused, naming both; 1 held
#: every table in ps.pt)
FORMAT = 2

# ---- files ----------------------------------------------------------------------------------------


def _write(path: Path, obj: Any) -> None:
    """``torch.save(obj)`` to ``path`` whole or not at all: under a ``.part`` name, fsynced,
    then renamed."""
    _write_bytes(path, save_bytes(obj))


def _write_bytes(path: Path, data: bytes | memoryview, fsync: bool = True) -> None:
    """Write ``data`` to ``path`` whole or not at all: under a ``.part`` name, fsynced (unless
    not ``fsync``: the caller makes it durable later), then renamed."""
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(part, path)


def _files(directory: Path) -> list[Path]:
    """The files a checkpoint's manifest lists: every file of ``directory`` but the manifest and
    unfinished ``.part`` files, and of ``ps/`` only its manifest (which lists every shard file
    with its size and checksum: the servers check them as they load, see :func:`_unloadable`)."""
    ps = directory / PS_DIR
    return sorted(p for p in directory.rglob("*") if p.is_file() and p != directory / MANIFEST
                  and not p.name.endswith(".part") and (ps not in p.parents or p == ps / PS_MANIFEST))


def _trainer_file(rank: int) -> str:
    return f"trainer-{rank}.pt"


def complete_checkpoints(path: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, directory)`` of every checkpoint under ``path`` that was completed (renamed
    from its staging name), oldest first; whether its files still hold is checked at resume.

    Example::

        complete_checkpoints("ckpt")   # [(100, Path("ckpt/step-00000100")), (200, ...)]
    """
    root = Path(path)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _COMPLETE.match(p.name))]
    return sorted(found)


def _unloadable(directory: Path, step: int, trainers: int) -> str | None:
    """Why the checkpoint ``directory`` cannot be loaded by ``trainers`` trainers, or None:
    its manifest, and every file it lists at its size and checksum."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        return f"it has no {MANIFEST}"
    except (OSError, ValueError) as e:
        return f"its {MANIFEST} is unreadable ({e})"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else manifest
        return f"its {MANIFEST} is not of format {FORMAT} (got {got!r})"
    if manifest.get("step") != step:
        return f"its {MANIFEST} is for step {manifest.get('step')}, its name for step {step}"
    if manifest.get("trainers") != trainers:
        return f"it was saved by {manifest.get('trainers')} trainers, this job has {trainers}"
    for name, entry in sorted(manifest.get("files", {}).items()):
        file = directory / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != entry["bytes"]:
            return f"{name} has {size} bytes, the manifest says {entry['bytes']} (truncated or overwritten)"
        if file_sha256(file) != entry["sha256"]:
            return f"{name} does not match its checksum in the manifest (corrupted)"
    return _shards_unloadable(directory)


def _shards_unloadable(directory: Path) -> str | None:
    """Why the servers' shard files (``ps/``) cannot be loaded, as far as the trainer sees without
    reading them, or None: each file ``ps/manifest.json`` lists, there and of its size. (Their
    checksums the servers check as they load: a corrupt one raises CheckpointError naming it, and
    resume() tries the checkpoint before.)"""
    if not (directory / PS_DIR / PS_MANIFEST).is_file():
        return None
    try:
        files = read_manifest(str(directory / PS_DIR))["files"]
    except CheckpointError as e:
        return str(e)
    for rel, entry in sorted(files.items()):
        file = directory / PS_DIR / rel
        if not file.is_file():
            return f"{PS_DIR}/{rel} is missing"
        size = file.stat().st_size
        if size != entry["bytes"]:
            return (f"{PS_DIR}/{rel} has {size} bytes, {PS_DIR}/{PS_MANIFEST} says {entry['bytes']} "
                    "(truncated or overwritten)")
    return None
