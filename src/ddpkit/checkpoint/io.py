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
import io
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from ddpkit.errors import DataError

MANIFEST = "manifest.json"
STATE_FILE = "state.pt"
SLOW_SAVE_ENV = "DDPKIT_TEST_SLOW_SAVE_S"  # a testing hook: every write sleeps this long
FORMAT_VERSION = 2  # 2: the manager's {name: state dict} under "state"


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


def write_checkpoint(directory: Path, step: int, state: dict[str, Any], meta: dict) -> Path:
    """Write ``state`` as checkpoint ``step`` under ``directory`` atomically; returns its folder.

    Not a collective: call it on the one rank that writes (rank 0 for replicated state).
    An existing checkpoint of the same step is replaced. On any error (a state torch cannot
    pickle, a manifest that is not JSON, a full disk) the temporary folder is removed before
    the error propagates: nothing half-written stays behind.
    """
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / checkpoint_dir_name(step)
    tmp = directory / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _write_files(tmp, step, state, meta)
    except BaseException:  # a state that cannot be pickled, a full disk, an interrupt
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():  # re-saving a step after a restart: the older ones stay as fallbacks
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync(directory)
    return final


def _write_files(tmp: Path, step: int, state: dict[str, Any], meta: dict) -> None:
    torch.save(state, tmp / STATE_FILE)
    _fsync(tmp / STATE_FILE)
    if os.environ.get(SLOW_SAVE_ENV):  # tests: a save long enough to signal during it
        time.sleep(float(os.environ[SLOW_SAVE_ENV]))
    manifest = {
        "format": FORMAT_VERSION,
        "step": step,
        "files": {STATE_FILE: sha256_file(tmp / STATE_FILE)},
        **meta,
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    _fsync(tmp / MANIFEST)
    _fsync(tmp)


def probe_write_s(directory: Path, state: dict[str, Any]) -> float:
    """Seconds one checkpoint write of ``state`` takes in ``directory`` (written under a
    temporary name as :func:`write_checkpoint` does, then removed). Not a collective."""
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".tmp-probe-{os.getpid()}"
    start = time.perf_counter()
    try:
        tmp.mkdir(exist_ok=True)
        _write_files(tmp, 0, state, {})
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
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise DataError(
            f"incomplete checkpoint: path={folder} has no readable manifest ({exc}). Pass a "
            "complete step-XXXXXXXX folder, or resume 'auto' to pick the newest complete one."
        ) from None


def load_checkpoint(folder: Path) -> dict[str, Any]:
    """Read ``folder/state.pt`` once, check it against the manifest, and unpickle it on CPU.

    Raises:
        DataError: no manifest (incomplete), a missing file, or a SHA-256 that differs (names
            the file and both hashes).
    """
    expected = read_manifest(folder).get("files", {}).get(STATE_FILE)
    path = folder / STATE_FILE
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"corrupt checkpoint: cannot read {path} ({exc}).") from None
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected:
        raise DataError(
            f"corrupt checkpoint: path={path}, sha256={actual}, expected sha256={expected} "
            "(truncated or altered after it was written)."
        )
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint folders under ``directory`` (complete or not), newest step first."""
    if not directory.is_dir():
        return []
    folders = [p for p in directory.glob("step-*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(folders, key=lambda p: int(p.name[5:]), reverse=True)
