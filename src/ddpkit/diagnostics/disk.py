"""A full disk said as one: which disk, how much is free, what needed writing, and the fix.

torch.save reports a write that ran out of space in its own words, without ``errno``:
``[enforce fail at inline_container.cc:672] . unexpected pos 843200 vs 843152`` (its zip writer
found the file shorter than what it wrote), ``basic_ios::clear: iostream error``, or
``PytorchStreamWriter failed writing file data/0: file write failed``. Python's own writes (a
manifest, ``torch.distributed.checkpoint``'s files) raise ``OSError`` with ``ENOSPC`` (or
``EDQUOT``, a quota). A torch write failure is taken for a full disk only when the filesystem
it wrote to has less room left than the write needed, measured at the failure (before the
partial file is removed); other write failures keep their own message.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ddpkit.errors import DiskFullError

TORCH_WRITE_FAILED = (
    "unexpected pos ",
    "file write failed",
    "basic_ios::clear",
    "PytorchStreamWriter failed writing",
)
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
MIN_FREE_BYTES = 1 << 20  # what a write needs when its size is unknown
CHECKPOINT_FIX = (
    "Free space there, write checkpoints to a disk with room (ddpkit train --output-dir DIR; "
    "CheckpointManager's directory), or keep fewer (CheckpointManager keep_last: a save needs "
    "room for one more checkpoint before the oldest is pruned)"
)


def format_bytes(num_bytes: float) -> str:
    """``0 B``, ``843.0 KiB``, ``1.1 MiB``, ``23.5 GiB`` (powers of 1024).

    Example:
        >>> format_bytes(3 * 2**20 // 2)
        '1.5 MiB'
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num_bytes) < 1024 or unit == "GiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in ``obj`` (nested dicts, lists and tuples): about what a
    ``torch.save`` of it writes."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(value) for value in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(value) for value in obj)
    return 0


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, its causes and contexts, and the per-rank errors of a
    ``torch.distributed.checkpoint`` ``CheckpointException`` (its ``failures``)."""
    stack: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while stack:
        item = stack.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        yield item
        stack += [item.__cause__, item.__context__]
        failures = getattr(item, "failures", None)
        if isinstance(failures, dict):  # {rank: (exception, traceback frames)}
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()]


def write_failure(exc: BaseException) -> int | None:
    """How ``exc`` says a write failed for lack of room: the ``errno`` (``ENOSPC``, ``EDQUOT``)
    where an ``OSError`` says so, 0 for torch's own write failure (no ``errno``), else ``None``."""
    found = None
    for item in _chain(exc):
        if isinstance(item, OSError) and item.errno in NO_SPACE_ERRNOS:
            return item.errno
        if any(text in str(item) for text in TORCH_WRITE_FAILED):
            found = 0
    return found


def disk_full_error(
    exc: BaseException,
    directory: str | os.PathLike[str],
    what: str,
    need_bytes: int | None = None,
    fix: str = CHECKPOINT_FIX,
) -> DiskFullError | None:
    """The one-line error for ``exc`` when it is a write into ``directory`` that ran out of
    room, else ``None``.

    Args:
        exc: what the write raised.
        directory: a folder on the filesystem written to (measured with ``shutil.disk_usage``).
        what: what was being written, e.g. ``"checkpoint step-00000004"``.
        need_bytes: about how many bytes the write needed (``None``: unknown).
        fix: how to fix it, one sentence without its full stop.

    Example:
        >>> disk_full_error(ValueError("bad"), "/", "x") is None
        True
    """
    code = write_failure(exc)
    if code is None:
        return None
    usage = stat = None
    with contextlib.suppress(OSError):
        usage, stat = shutil.disk_usage(directory), os.statvfs(directory)
    if code == 0 and (usage is None or usage.free >= max(need_bytes or 0, MIN_FREE_BYTES)):
        return None  # torch's write failed, but not for lack of room
    where = os.path.abspath(directory)
    if code == errno.EDQUOT:
        reason = f"the disk quota on the filesystem holding {where} is used up"
    elif stat is not None and stat.f_files and stat.f_favail == 0:
        reason = f"the filesystem holding {where} has no free inodes left (free=0 inodes)"
    else:
        reason = f"the disk holding {where} is full"
    if usage is not None:
        reason += f" (free={format_bytes(usage.free)} of {format_bytes(usage.total)})"
    need = f"; it needs about {format_bytes(need_bytes)}" if need_bytes else ""
    error = DiskFullError(f"{what} not written: {reason}{need}. {fix}.")
    error.errno = code or errno.ENOSPC
    return error


@contextlib.contextmanager
def disk_full_explained(
    directory: str | os.PathLike[str], what: str, need_bytes: int | None = None
) -> Iterator[None]:
    """Turn a write in the block that ran out of room into :func:`disk_full_error`'s error
    (raised from the original); any other error passes unchanged.

    Raises:
        DiskFullError: the block's write failed for lack of room in ``directory``.
    """
    try:
        yield
    except BaseException as exc:  # torch.distributed.checkpoint's CheckpointException too
        full = disk_full_error(exc, Path(directory), what, need_bytes)
        if full is None:
            raise
        raise full from exc
