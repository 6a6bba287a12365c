"""Failure records: each failing worker writes one; the launcher names the rank that failed first.

torchrun's own report orders failures by whole-second timestamps from error files that only
``@record``-decorated entry points write, and otherwise lists whichever rank it noticed — often a
rank it terminated itself. ddpkit's worker bootstrap writes a record with a sub-millisecond
wall-clock time the moment an exception escapes, *before* it tears down its process group, so
the root cause is always older than the errors it provokes on the peers.
"""

from __future__ import annotations

import json
import os
import runpy
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ddpkit.diagnostics.translate import explain
from ddpkit.errors import DdpkitError

RUN_DIR_ENV = "DDPKIT_RUN_DIR"
LAUNCHER_PID_ENV = "DDPKIT_LAUNCHER_PID"


@dataclass(frozen=True)
class FailureRecord:
    """What one worker knew when its exception escaped.

    Attributes:
        rank, local_rank, world_size: the worker's coordinates.
        restart: torchrun's restart count (``TORCHELASTIC_RESTART_COUNT``).
        type: the exception's class name, e.g. ``ValueError``.
        message: ``str(exception)``.
        traceback: the formatted traceback (empty for ddpkit's own errors and ``SystemExit``).
        time_s: wall-clock time of the failure, seconds since the epoch.
        pid: the worker's process id.
        hint: the explanation and fix for a known failure (:func:`ddpkit.diagnostics.translate.
            explain`), or ``""``.
        collective: the torch.distributed call it was raised in, with its tensor and the user's
            line (``"all_reduce of float32 (8,) at train.py:13"``), or ``""``.
    """

    rank: int
    local_rank: int
    world_size: int
    restart: int
    type: str
    message: str
    traceback: str
    time_s: float
    pid: int
    hint: str = ""
    collective: str = ""

    @property
    def headline(self) -> str:
        """``rank 1/2 (local rank 1, pid 123): ValueError: boom`` (first line of the message)."""
        message = self.message.strip().splitlines()[0] if self.message.strip() else ""
        return (
            f"rank {self.rank}/{self.world_size} (local rank {self.local_rank}, pid {self.pid}): "
            f"{self.type}: {message}"
        )


_FAILED_AT = "ddpkit_failed_at_s"


def stamp_failure_time(exc: BaseException) -> None:
    """Remember when ``exc`` first reached ddpkit (kept if already set).

    Called by :meth:`ddpkit.Runtime.__exit__` before it tears the process group down: the
    teardown is what makes the peers fail, so the root cause must carry the earlier time.
    """
    if not hasattr(exc, _FAILED_AT):
        try:
            setattr(exc, _FAILED_AT, time.time())
        except AttributeError:  # an exception type with __slots__; the record time will do
            pass


_BOOTSTRAP_FILES = {runpy.__file__, "<frozen runpy>"}


def register_bootstrap_file(path: str) -> None:
    """Leave the frames of ``path`` (a launcher's worker bootstrap) out of failure tracebacks."""
    _BOOTSTRAP_FILES.add(os.path.abspath(path))


def _user_traceback(exc: BaseException) -> str:
    """The formatted traceback without the bootstrap's own frames (ddpkit's worker, runpy)."""
    skip = _BOOTSTRAP_FILES
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename in skip:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def make_record(exc: BaseException, environ: dict[str, str] | None = None) -> FailureRecord:
    """Build the record of ``exc`` for this worker, reading its coordinates from the environment."""
    env = os.environ if environ is None else environ
    return FailureRecord(
        rank=int(env.get("RANK", 0)),
        local_rank=int(env.get("LOCAL_RANK", 0)),
        world_size=int(env.get("WORLD_SIZE", 1)),
        restart=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
        type=type(exc).__name__,
        message=f"exit status {exc.code}" if isinstance(exc, SystemExit) else str(exc),
        # ddpkit's own errors say what failed and how to fix it: the traceback adds only noise
        traceback="" if isinstance(exc, (SystemExit, DdpkitError)) else _user_traceback(exc),
        time_s=getattr(exc, _FAILED_AT, None) or time.time(),
        pid=os.getpid(),
        # ddpkit's own errors already say what to do
        hint="" if isinstance(exc, (SystemExit, DdpkitError)) else explain(exc) or "",
        collective=_collective(exc),
    )


def _collective(exc: BaseException) -> str:
    from ddpkit.watchdog.position import collective_in_traceback

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:  # a translated error: its cause too
        seen.add(id(current))
        found = collective_in_traceback(current)
        if found:
            return found
        current = current.__cause__ or current.__context__
    return ""


def write_record(record: FailureRecord, run_dir: str | os.PathLike[str]) -> Path:
    """Write ``record`` atomically (temp file + rename) into ``run_dir``; returns the path."""
    directory = Path(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"failure-r{record.restart}-rank{record.rank}.json"
    tmp = path.with_suffix(f".tmp{record.pid}")
    tmp.write_text(json.dumps(asdict(record)))
    os.replace(tmp, path)
    return path


def record_failure(exc: BaseException) -> None:
    """Write the record of ``exc`` into the launcher's run folder (``$DDPKIT_RUN_DIR``), if any.

    The recorder the watchdog is given (:func:`ddpkit.init_runtime`); a no-op outside ``ddpkit
    run``.
    """
    if os.environ.get(RUN_DIR_ENV):
        write_record(make_record(exc), os.environ[RUN_DIR_ENV])


NEWEST_CHECKPOINT = "newest-checkpoint"  # in the run folder: the job's newest complete one


def note_checkpoint(folder: str | os.PathLike[str]) -> None:
    """Tell the launcher the job's newest complete checkpoint (a file in ``$DDPKIT_RUN_DIR``,
    replaced atomically), so its failure line can name it even when no rank lives to say.
    A no-op outside ``ddpkit run``/``ddpkit train``'s launcher."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return
    path = Path(run_dir) / NEWEST_CHECKPOINT
    tmp = path.with_name(f".{NEWEST_CHECKPOINT}.{os.getpid()}")
    try:
        tmp.write_text(str(Path(folder).absolute()))
        os.replace(tmp, path)
    except OSError:
        pass  # the launcher's folder is gone (it is ending): nothing to tell


def newest_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    """The folder :func:`note_checkpoint` last named in ``run_dir``, if it still exists."""
    try:
        folder = Path((Path(run_dir) / NEWEST_CHECKPOINT).read_text())
    except OSError:
        return None
    return folder if folder.is_dir() else None


def _read(run_dir: str | os.PathLike[str], pattern: str, kind: type) -> list[Any]:
    records = []
    for path in Path(run_dir).glob(pattern):
        try:
            records.append(kind(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue  # a worker killed while writing leaves only its .tmp file; skip stragglers
    return records


def read_records(run_dir: str | os.PathLike[str]) -> list[FailureRecord]:
    """All complete records in ``run_dir``, oldest first (the first failure leads)."""
    return sorted(_read(run_dir, "failure-*.json", FailureRecord), key=lambda r: r.time_s)


def take_records(run_dir: str | os.PathLike[str], pid: int) -> list[FailureRecord]:
    """The failure records of process ``pid``, removed from ``run_dir`` (live fault tolerance:
    a failure the job survived is not its outcome)."""
    taken = []
    for path in Path(run_dir).glob("failure-*.json"):
        try:
            record = FailureRecord(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue  # a straggler, as read_records skips it
        if record.pid == pid:
            taken.append(record)
            path.unlink(missing_ok=True)
    return sorted(taken, key=lambda r: r.time_s)


@dataclass(frozen=True)
class StopRecord:
    """What one worker wrote when it stopped on a signal (:class:`ddpkit.TrainingStopped`).

    Attributes:
        rank, world_size, restart, pid: the worker's coordinates.
        signal: the signal's name (``"SIGTERM"``); ``now``: a second signal stopped it at once.
        step: the step every rank finished before stopping (``None`` for a stop now).
        checkpoint: the newest complete checkpoint folder when it stopped, or ``None``;
            ``saved``: this stop wrote it, at ``step``.
        note: where in the program, e.g. ``ddpkit train``'s ``"(epoch 2/5)"``.
        time_s: wall-clock time of the stop, seconds since the epoch.
    """

    rank: int
    world_size: int
    restart: int
    pid: int
    signal: str
    now: bool
    step: int | None
    checkpoint: str | None
    saved: bool
    note: str
    time_s: float


def write_stop_record(stopped: Any, run_dir: str | os.PathLike[str]) -> Path:
    """Write the record of ``stopped`` (a :class:`~ddpkit.TrainingStopped`) atomically into
    ``run_dir``; returns its path."""
    env = os.environ
    record = StopRecord(
        rank=int(env.get("RANK", 0)),
        world_size=int(env.get("WORLD_SIZE", 1)),
        restart=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
        pid=os.getpid(),
        signal=stopped.signal.name,
        now=stopped.now,
        step=stopped.step,
        checkpoint=None if stopped.checkpoint is None else str(stopped.checkpoint),
        saved=stopped.saved,
        note=getattr(stopped, "note", ""),
        time_s=time.time(),
    )
    path = Path(run_dir) / f"stop-r{record.restart}-rank{record.rank}.json"
    tmp = path.with_suffix(f".tmp{record.pid}")
    tmp.write_text(json.dumps(asdict(record)))
    os.replace(tmp, path)
    return path


def read_stop_records(run_dir: str | os.PathLike[str]) -> list[StopRecord]:
    """The stop records of the newest attempt that has any, by rank."""
    records = _read(run_dir, "stop-*.json", StopRecord)
    newest = max((r.restart for r in records), default=0)
    return sorted((r for r in records if r.restart == newest), key=lambda r: r.rank)


def write_done_record(run_dir: str | os.PathLike[str]) -> Path:
    """Mark that this worker's script ran to its end (exit 0), for the launcher."""
    restart, rank = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), os.environ.get("RANK", "0")
    path = Path(run_dir) / f"done-r{restart}-rank{rank}"
    path.touch()
    return path


def newest_done_time(run_dir: str | os.PathLike[str]) -> float:
    """When the last worker that ran its script to its end wrote its record (``time.time()``
    seconds; 0 when none did)."""
    return max((p.stat().st_mtime for p in Path(run_dir).glob("done-r*-rank*")), default=0.0)


def done_ranks(run_dir: str | os.PathLike[str], restart: int) -> set[int]:
    """The ranks of attempt ``restart`` that ran their script to its end."""
    paths = Path(run_dir).glob(f"done-r{restart}-rank*")
    return {int(p.name.rsplit("rank", 1)[1]) for p in paths}


def count_done_records(run_dir: str | os.PathLike[str]) -> int:
    """How many workers of the newest attempt that has any ran their script to its end."""
    restarts = [int(p.name.split("-")[1][1:]) for p in Path(run_dir).glob("done-r*-rank*")]
    newest = max(restarts, default=0)
    return len(list(Path(run_dir).glob(f"done-r{newest}-rank*")))
