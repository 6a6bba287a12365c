"""What an interrupted ``ddpkit train`` left behind, and the command that continues it."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from ddpkit.checkpoint.manager import newest_manifest


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


def interrupted_note(output_dir: str | os.PathLike[str], argv: list[str]) -> str:
    """The end of Ctrl-C's one line: the newest complete checkpoint and how to resume from it.

    Args:
        output_dir: the run's ``--output-dir`` (checkpoints are in its ``checkpoints/``).
        argv: the user's ``ddpkit`` arguments, starting with ``train``.

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
    return f"; saved: checkpoint {folder.name} in {folder.parent}; resume with: {command}"
