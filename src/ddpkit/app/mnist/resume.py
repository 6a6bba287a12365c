"""What an interrupted ``ddpkit train`` left behind, and the command that continues it."""

from __future__ import annotations

import os
import shlex
import signal
from pathlib import Path

from ddpkit.checkpoint.manager import newest_manifest
from ddpkit.distributed.stop import TrainingStopped


def without_resume(argv: list[str]) -> list[str]:
    """``argv`` without its ``--resume X`` / ``--resume=X`` (the continuation adds its own)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--resume":
            skip = True
        elif not arg.startswith("--resume="):
            kept.append(arg)
    return kept


def interrupted_note(
    output_dir: str | os.PathLike[str], argv: list[str], *, saved: bool = True
) -> str:
    """The end of a stop's one line: the newest complete checkpoint and how to resume from it.

    Args:
        output_dir: the run's ``--output-dir`` (checkpoints are in its ``checkpoints/``).
        argv: the user's ``ddpkit`` arguments, starting with ``train``.
        saved: the ranks saved the step they stopped at (else the newest checkpoint is an
            older one, and the line says so).

    Returns:
        ``"; saved: checkpoint step-00000036 in DIR; resume with: ddpkit train ... --resume
        auto"``, or a note that nothing was saved.

    Example:
        >>> interrupted_note("/nonexistent", ["train"])
        '; no checkpoint saved (--checkpoint-every N saves them): a rerun starts at step 0'
    """
    found = newest_manifest(Path(output_dir) / "checkpoints")
    if found is None:
        return "; no checkpoint saved (--checkpoint-every N saves them): a rerun starts at step 0"
    folder = found[0]
    command = shlex.join(["ddpkit", *without_resume(argv), "--resume", "auto"])
    label = "saved: checkpoint" if saved else "the newest complete checkpoint is"
    return f"; {label} {folder.name} in {folder.parent}; resume with: {command}"


def stop_note(stopped: TrainingStopped, output_dir: str | os.PathLike[str], argv: list[str]) -> str:
    """The one line of a ``ddpkit train`` that trained in this process (one process, or plain
    torchrun) and stopped on a signal: where, the checkpoint, how to resume.

    ``argv``: the user's ``ddpkit`` arguments (``[]`` under torchrun, whose command ddpkit does
    not know: the line says to rerun it with ``--resume auto``).
    """
    label = (
        "interrupted (Ctrl-C)"
        if stopped.signal == signal.SIGINT
        else f"stopped by {stopped.signal.name}"
    )
    where = (
        "at once (a second signal)"
        if stopped.now
        else f"after step {stopped.step} {stopped.note}".rstrip()
    )
    if argv:
        note = interrupted_note(output_dir, argv, saved=stopped.saved)
    else:
        found = newest_manifest(Path(output_dir) / "checkpoints")
        label_kept = "saved: checkpoint" if stopped.saved else "the newest complete checkpoint is"
        kept = (
            f"; {label_kept} {found[0].name} in {found[0].parent}" if found else "; no checkpoint"
        )
        note = f"{kept}; resume: rerun the same torchrun command with --resume auto"
    return f"ddpkit train: {label} {where}{note}"
