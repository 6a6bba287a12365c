"""Atomic, checksummed checkpoint folders.

A checkpoint is a folder ``step-00000120/`` holding ``state.pt`` and ``manifest.json``. It is
written under a temporary name in the same parent folder, every file fsynced, then renamed into
place in one ``rename`` and the parent folder fsynced: a reader sees either the whole checkpoint
or none of it, and a writer killed at any moment leaves at most a ``.tmp-*`` folder behind.
``manifest.json`` lists the SHA-256 of every file, so a later truncation or bit flip is detected.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from ddpkit.diagnostics.disk import disk_full_explained, tensor_bytes
from ddpkit.diagnostics.failures import stamp_failure_time
from ddpkit.errors import DataError
from ddpkit.security.safe_load import load_state_bytes

MANIFEST = "manifest.json"
STATE_FILE = "state.pt"
FORMAT_VERSION = 2  # 2: the manager's {name: state dict} under "state"
KNOWN_FORMATS = (1, 2)  # 1 is read to be refused with its own message (manager.py)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def temporary_dir(directory: Path, step: int, pid: int | None = None) -> Path:
    """Where checkpoint ``step`` is written before its rename: ``.tmp-step-XXXXXXXX-<pid>``
    (``pid``: the writer's, or for a sharded checkpoint rank 0's, which every rank shares)."""
    return directory / f".tmp-{checkpoint_dir_name(step)}-{os.getpid() if pid is None else pid}"


def write_checkpoint(directory: Path, step: int, state: dict[str, Any], meta: dict) -> Path:
    """Write ``state`` as checkpoint ``step`` under ``directory`` atomically; returns its folder.

    Not a collective: call it on the one rank that writes (rank 0 for replicated state).
    An existing checkpoint of the same step is replaced. On any error (a state torch cannot
    pickle, a manifest that is not JSON, a full disk) the temporary folder is removed before
    the error propagates: nothing half-written stays behind.

    Raises:
        DiskFullError: the disk ran out of room (names it, its free space, what the checkpoint
            needs and the fix) instead of torch's ``unexpected pos A vs B``.
    """
    directory.mkdir(parents=True, exist_ok=True)
    tmp = temporary_dir(directory, step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return commit_checkpoint(tmp, directory, step, state, meta)


def commit_checkpoint(
    tmp: Path,
    directory: Path,
    step: int,
    state: dict[str, Any] | None,
    meta: dict,
    files: dict[str, str] | None = None,
) -> Path:
    """Add ``state.pt`` and the manifest to the temporary folder ``tmp``, then rename it to
    ``step-XXXXXXXX`` in one ``rename``; returns the final folder. Not a collective.

    ``files``: SHA-256 of files already in ``tmp`` (a sharded checkpoint's DCP shards, by path
    relative to ``tmp``), listed in the manifest beside ``state.pt``'s. ``state=None``: ``state.pt``
    is in ``tmp`` already (:func:`write_state_file`). On any error ``tmp`` is removed before the
    error propagates.
    """
    final = directory / checkpoint_dir_name(step)
    try:
        with disk_full_explained(directory, f"checkpoint {final.name}", tensor_bytes(state)):
            _write_files(tmp, step, state, meta, files or {})
    except BaseException as exc:  # a state that cannot be pickled, a full disk, an interrupt
        # the cause's time, before any collective tells the other ranks: the launcher names
        # the rank that failed first, not a peer that raised on hearing of it
        stamp_failure_time(exc)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():  # re-saving a step after a restart: the older ones stay as fallbacks
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync(directory)
    return final


def write_state_file(tmp: Path, state: dict[str, Any]) -> None:
    """``tmp/state.pt`` written and fsynced (an asynchronous save writes it first)."""
    torch.save(state, tmp / STATE_FILE)
    _fsync(tmp / STATE_FILE)


def _write_files(
    tmp: Path, step: int, state: dict[str, Any] | None, meta: dict, files: dict
) -> None:
    if state is not None:
        write_state_file(tmp, state)
    manifest = {
        "format": FORMAT_VERSION,
        "step": step,
        "files": {**files, STATE_FILE: sha256_file(tmp / STATE_FILE)},
        **meta,
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    _fsync(tmp / MANIFEST)
    for sub in {Path(name).parent for name in files} - {Path(".")}:
        _fsync(tmp / sub)
    _fsync(tmp)


def probe_write_s(directory: Path, state: dict[str, Any]) -> float:
    """Seconds one checkpoint write of ``state`` takes in ``directory`` (written under a
    temporary name as :func:`write_checkpoint` does, then removed). Not a collective.

    Raises:
        DiskFullError: the disk has no room for one checkpoint (see :func:`write_checkpoint`).
    """
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".tmp-probe-{os.getpid()}"
    start = time.perf_counter()
    try:
        tmp.mkdir(exist_ok=True)
        with disk_full_explained(directory, "trial checkpoint", tensor_bytes(state)):
            _write_files(tmp, 0, state, {}, {})
        return time.perf_counter() - start
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):
                directory.rmdir()  # leave no empty folder behind


def read_manifest(folder: Path) -> dict:
    """The manifest of a checkpoint folder.

    Raises:
        DataError: missing or unreadable manifest (an incomplete checkpoint).
    """
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise DataError(
            f"incomplete checkpoint: path={folder} has no readable manifest ({exc}). Pass a "
            "complete step-XXXXXXXX folder, or resume 'auto' to pick the newest complete one."
        ) from None
    version = manifest.get("format") if isinstance(manifest, dict) else None
    if version not in KNOWN_FORMATS:
        raise DataError(
            f"checkpoint of an unknown format: path={folder}, format={version!r}; this ddpkit "
            f"reads formats {', '.join(map(str, KNOWN_FORMATS))}. Resume it with the ddpkit "
            "that wrote it, or start fresh."
        )
    return manifest


def load_checkpoint(folder: Path, *, unsafe_pickle: bool = False) -> dict[str, Any]:
    """Read ``folder/state.pt`` once, check it against the manifest, and unpickle it on CPU
    with only safe types allowed (:mod:`ddpkit.security.safe_load`; ``unsafe_pickle``: any
    object, which runs whatever code the file holds).

    Every other file the manifest lists (the DCP shards of a sharded checkpoint) is checked
    against its SHA-256 first. Not a collective: each rank reads and checks every file.

    Raises:
        DataError: no manifest (incomplete), an unknown manifest format, a missing file, a
            SHA-256 that differs (names the file and both hashes), or an object outside the
            allow-list (names it).
    """
    files = read_manifest(folder).get("files", {})
    for name in sorted(files):  # a sharded checkpoint's DCP shards too
        if name != STATE_FILE:
            _verify(folder / name, files[name], sha256_file)
    data = _verify(folder / STATE_FILE, files.get(STATE_FILE), lambda p: p.read_bytes())
    return load_state_bytes(data, folder / STATE_FILE, unsafe_pickle=unsafe_pickle)


def _verify(path: Path, expected: str | None, read: Any) -> Any:
    """``read(path)`` once its SHA-256 is ``expected``; returns what ``read`` gave.

    Raises:
        DataError: the file cannot be read, or its SHA-256 differs (names both hashes).
    """
    try:
        data = read(path)
    except OSError as exc:
        raise DataError(f"corrupt checkpoint: cannot read {path} ({exc}).") from None
    actual = data if isinstance(data, str) else hashlib.sha256(data).hexdigest()
    if actual != expected:
        raise DataError(
            f"corrupt checkpoint: path={path}, sha256={actual}, expected sha256={expected} "
            "(truncated or altered after it was written)."
        )
    return data


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint folders under ``directory`` (complete or not), newest step first."""
    if not directory.is_dir():
        return []
    folders = [p for p in directory.glob("step-*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(folders, key=lambda p: int(p.name[5:]), reverse=True)
