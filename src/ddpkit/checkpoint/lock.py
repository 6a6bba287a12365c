"""One job per checkpoint folder: an exclusive lock held by the job's rank 0.

Two jobs writing one folder delete each other's checkpoints (each prunes to its own
``keep_last``, and removes the other's save in progress as debris) and resume each other's
steps. :class:`~ddpkit.checkpoint.manager.CheckpointManager` therefore takes
``DIRECTORY/.ddpkit-lock`` when it is built, on rank 0, with ``flock(LOCK_EX | LOCK_NB)``
(``flock(2)``), and holds it while the manager lives. A second job's rank 0 is refused in one
line naming the holder (pid, host, command, since when), read from the lock file.

A stale lock needs no clean-up: the kernel drops a ``flock`` when its holder exits, however it
exits (``kill -9`` included), and the next job takes the lock and rewrites the file. Managers of
one process on one folder share the lock. On NFS, Linux maps ``flock`` to NFS byte-range
locks (``nfs(5)``, ``local_lock``), so jobs on different machines exclude each other as long as
the mount does not use ``local_lock=flock``/``all``.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import weakref
from pathlib import Path
from typing import Any

from ddpkit.errors import ConfigError
from ddpkit.log import get_logger

LOCK_NAME = ".ddpkit-lock"
NO_LOCKS = {errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK}  # flock(2): the file system has none
_held: dict[Path, list[int]] = {}  # resolved directory -> [fd, managers holding it]
_warned: set[Path] = set()
log = get_logger("checkpoint")


def _command(pid: int | str) -> str:
    """The command line of process ``pid`` (``/proc``; empty where there is none)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:200]


def _owner() -> dict[str, Any]:
    owner: dict[str, Any] = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "command": " ".join(sys.orig_argv)[:200],
        "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a worker: the command the user ran is its parent's
        owner["launcher_pid"] = os.getppid()
        owner["launcher_command"] = _command(os.getppid())
    return owner


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode())
        started = ""
        if info.get("launcher_pid"):
            started = f", started by pid {info['launcher_pid']} {info['launcher_command']!r}"
        return (
            f"pid {info['pid']} on {info['host']} ({info['command']!r}{started}, "
            f"since {info['since']})"
        )
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (its lock file names no owner yet)"


def _refusal(directory: Path, holder: str) -> ConfigError:
    return ConfigError(
        f"checkpoint folder {directory} is in use by another job: {holder}. Two jobs on one "
        "folder delete and resume each other's checkpoints. Wait for it to end or stop it, or "
        "give this job another folder."
    )


def _unsupported(exc: OSError) -> bool:
    """Whether ``flock`` failed because the file system has no locks (some FUSE and NFS
    mounts, Lustre ``noflock``): the job then runs without one, warned once."""
    return exc.errno in NO_LOCKS


def _warn_unlocked(directory: Path, exc: OSError) -> None:
    if directory not in _warned:
        _warned.add(directory)
        log.warning(
            "checkpoint folder %s: its file system has no flock (%s): one job per folder is "
            "not enforced there; make sure no other job writes it.",
            directory,
            exc.strerror,
        )


def check_unlocked(directory: Path) -> None:
    """Refuse a folder another job holds, before this job starts its workers; takes nothing.

    Not a collective. Nothing happens when the folder or its lock file does not exist yet, or
    when its file system has no locks.

    Raises:
        ConfigError: another process holds ``directory``'s lock (named).
    """
    try:
        fd = os.open(directory / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return  # no lock file (or none readable): the workers' own check will tell
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # any holder's LOCK_EX refuses it
    except BlockingIOError:
        raise _refusal(directory, _holder(fd)) from None
    except OSError as exc:
        if not _unsupported(exc):
            raise
    finally:
        os.close(fd)  # closing drops the probe's own lock


def _take(directory: Path, key: Path) -> int | None:
    """Open and lock ``key``'s lock file, record this process as its owner; the descriptor,
    or ``None`` where the file system has no locks. Closes what it opened on any failure."""
    fd = os.open(key / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_owner()).encode(), 0)
        return fd
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise _refusal(directory, holder) from None
    except OSError as exc:
        os.close(fd)
        if not _unsupported(exc):
            raise
        _warn_unlocked(directory, exc)
        return None


def lock_directory(directory: Path, owner: object) -> None:
    """Take ``directory``'s checkpoint lock for ``owner`` (released when ``owner`` is garbage
    collected, or when the process exits). Creates ``directory``. Not a collective: call it on
    the job's rank 0. Where the file system has no locks, a warning says so and nothing is
    locked.

    Raises:
        ConfigError: another process holds the lock (named); the folder cannot be created or
            written (``EACCES``, read-only file system, ...).
    """
    try:
        directory.mkdir(parents=True, exist_ok=True)
        key = directory.resolve()
        if key in _held:
            _held[key][1] += 1
        else:
            fd = _take(directory, key)
            if fd is None:
                return
            _held[key] = [fd, 1]
    except OSError as exc:
        raise ConfigError(
            f"checkpoint folder {directory} cannot be written: {exc.strerror}. Give a folder "
            "this job can write (every rank must read it), e.g. --output-dir."
        ) from None
    weakref.finalize(owner, _release, key)


def _forget_in_child() -> None:
    """After ``fork`` (a DataLoader worker): the child closes its copies of the lock files, so
    the lock goes with the job's process, not with a child that outlives it."""
    for fd, _ in _held.values():
        os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _release(key: Path) -> None:
    entry = _held.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] == 0:
        del _held[key]
        os.close(entry[0])  # closing the only descriptor drops the flock
