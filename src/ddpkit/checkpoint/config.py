"""The checkpoint settings of ``ddpkit train``, each declared once, without torch.

:class:`CheckpointConfig` is a settings section (:mod:`ddpkit.settings`) whose fields carry
their flag, default, help and check; ``ddpkit train`` composes it (the ``[checkpoint]`` section
of ``--config``) and hands the values to :class:`~ddpkit.checkpoint.manager.CheckpointManager`
(``every_steps``, ``async_save``, ``unsafe_pickle``; ``keep_last`` is :data:`KEEP_LAST`).
:func:`checkpoint_rules` says what the settings cannot do together.

Example:
    >>> from ddpkit.checkpoint.config import CheckpointConfig, checkpoint_rules
    >>> checkpoint_rules(CheckpointConfig(async_checkpoint=True))
    ["async_checkpoint=True with checkpoint_every=0. Only the periodic checkpoints are ..."]
    >>> checkpoint_rules(CheckpointConfig(async_checkpoint=True, checkpoint_every=100))
    []
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ddpkit.settings import at_least, option

__all__ = ["KEEP_LAST", "CheckpointConfig", "checkpoint_rules"]

KEEP_LAST = 3  # complete checkpoints a CheckpointManager keeps


def _resume_rule(value: str) -> str | None:
    ok = value in ("", "auto") or Path(value).is_dir()
    return None if ok else "is neither '' (start fresh), 'auto' nor a checkpoint folder"


@dataclass(frozen=True)
class CheckpointConfig:
    """checkpoints and resuming"""

    checkpoint_every: int = option(
        0,
        "save a checkpoint to OUTPUT_DIR/checkpoints every STEPS optimizer steps "
        f"(0 = never; keeps the last {KEEP_LAST})",
        check=at_least(0),
        metavar="STEPS",
    )
    async_checkpoint: bool = option(
        False,
        "fsdp/zero1: write each checkpoint's shards in a background thread "
        "(torch.distributed.checkpoint.async_save); the save is committed at the next one or "
        "at the end of training, so the loop waits only for the copy to CPU memory",
    )
    resume: str = option(
        "",
        "resume from the newest complete checkpoint in OUTPUT_DIR (auto) or from PATH; "
        "another --nproc keeps the checkpoint's global batch (per-rank batch and micro-steps "
        "chosen again, said in one line)",
        check=_resume_rule,
        metavar="auto|PATH",
    )
    unsafe_pickle: bool = option(
        False,
        "UNSAFE: resume by unpickling any object a checkpoint holds, running whatever "
        "code it says (only for checkpoints you wrote and trust); default: tensors, numbers, "
        "strings, containers and numpy arrays only",
    )


def checkpoint_rules(settings: CheckpointConfig) -> list[str]:
    """What the checkpoint settings, each valid on its own, cannot do together."""
    if settings.async_checkpoint and not settings.checkpoint_every:
        return [
            "async_checkpoint=True with checkpoint_every=0. Only the periodic checkpoints are "
            "written in the background (a stop's checkpoint is committed before the exit). Add "
            "--checkpoint-every STEPS, or drop --async-checkpoint"
        ]
    return []
