"""Resuming ``ddpkit train``: the checkpoint it continues, how it splits the global batch on
this number of processes, and (after Ctrl-C) the command that continues it."""

from __future__ import annotations

import dataclasses
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from ddpkit.app.mnist.config import TrainConfig, resume_settings
from ddpkit.checkpoint.io import read_manifest
from ddpkit.checkpoint.manager import newest_manifest
from ddpkit.distributed.resize import fit_global_batch, world_sizes_for
from ddpkit.errors import ConfigError


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


@dataclass(frozen=True)
class BatchPlan:
    """How a run splits its global batch on this world size, and what its checkpoints record.

    A resumed run keeps the global batch of its checkpoint (``per-rank batch x micro-steps x
    world size``), so on another number of processes the per-rank batch and the micro-steps
    are chosen again (:func:`ddpkit.fit_global_batch`), with the same optimizer steps.

    Attributes:
        batch_size: samples per rank per micro-step on this world size.
        grad_accum: micro-steps per optimizer step on this world size.
        global_batch_size: samples per optimizer step over all ranks.
        requested: ``(--batch-size, --grad-accum)`` the run was started with; checkpoints
            record them, and a resume must ask for the same (or for another split of the same
            global batch on its world size).
        found: the checkpoint resumed, ``(folder, manifest)``; ``None`` for a fresh start.
        note: the info line of a resume that splits the global batch anew ("" otherwise).
    """

    batch_size: int
    grad_accum: int
    global_batch_size: int
    requested: tuple[int, int]
    found: tuple[Path, dict] | None = None
    note: str = ""


def resume_manifest(config: TrainConfig) -> tuple[Path, dict] | None:
    """The checkpoint ``--resume`` names (the newest complete one for ``auto``), unread."""
    if not config.resume:
        return None
    if config.resume == "auto":
        return newest_manifest(Path(config.output_dir) / "checkpoints")
    return Path(config.resume), read_manifest(Path(config.resume))


def plan_batch(config: TrainConfig, world_size: int) -> BatchPlan:
    """The per-rank batch and micro-steps of this run on ``world_size`` processes.

    A fresh run uses ``--batch-size`` and ``--grad-accum`` as given. A resume keeps its
    checkpoint's global batch: asked for the settings it was started with, it splits that
    batch over ``world_size`` with at most ``--batch-size`` per rank (unchanged on the world
    size it was started on); asked for another split of the same global batch, it uses that.
    Any other batch settings are left for :func:`~ddpkit.checkpoint.manager.check_compatible`
    to refuse. Not a collective: every rank reads the same manifest.

    Raises:
        ConfigError: the checkpoint's global batch does not split over ``world_size``
            processes (one line listing the numbers of processes that work).
        DataError: ``--resume PATH`` has no readable manifest.
    """
    asked = (config.batch_size, config.grad_accum)
    fresh = BatchPlan(*asked, asked[0] * asked[1] * world_size, asked)
    found = resume_manifest(config)
    extra = (found[1].get("extra") or {}) if found is not None else {}
    if found is None or "batch_size" not in extra:
        return dataclasses.replace(fresh, found=found)
    folder, manifest = found
    written_on = int(manifest.get("world_size") or world_size)
    requested = (int(extra["batch_size"]), int(extra.get("grad_accum", 1)))
    global_batch = int(extra.get("global_batch_size") or requested[0] * requested[1] * written_on)
    if asked == requested:
        try:
            split = fit_global_batch(global_batch, world_size, batch_size=requested[0])
        except ConfigError as exc:  # prefixed with the checkpoint and both sizes
            where = f"cannot resume {folder} on {world_size} process(es), written on {written_on}"
            raise ConfigError(f"{where}: {exc}") from None
    elif asked[0] * asked[1] * world_size == global_batch:
        split = asked  # the user's own split of the same global batch
    else:
        return dataclasses.replace(fresh, found=found)
    note = ""
    if written_on != world_size or split != requested:
        note = (
            f"resuming {folder.name} (written on {written_on} process(es)) on {world_size}: the "
            f"global batch stays {global_batch} = {split[0]} per rank x {split[1]} micro-step(s)"
            f" x {world_size}"
        )
    return BatchPlan(*split, global_batch, requested, found, note)


def checkpoint_settings(config: TrainConfig, dataset: str, plan: BatchPlan,
                        steps_per_epoch: int | None = None) -> dict:  # fmt: skip
    """The settings a checkpoint of this run records and a resume must share: the config's
    ``resume=True`` fields with the batch settings the run was started with, the data set, the
    global batch and (when known) the optimizer steps per epoch, which the LR schedule counts."""
    settings = {**resume_settings(config), "dataset": dataset}
    settings.update(batch_size=plan.requested[0], grad_accum=plan.requested[1],
                    global_batch_size=plan.global_batch_size)  # fmt: skip
    if steps_per_epoch is not None:
        settings["steps_per_epoch"] = steps_per_epoch
    return settings


def epoch_steps(num_samples: int, world_size: int, global_batch_size: int, max_steps: int) -> int:
    """Optimizer steps of one epoch: ``num_samples`` padded to a multiple of ``world_size`` (as
    ``DistributedSampler`` pads) in global batches, capped at ``max_steps`` (0 = no cap)."""
    padded = -(-num_samples // world_size) * world_size
    steps = -(-padded // global_batch_size)
    return min(steps, max_steps) if max_steps else steps


def check_epoch_steps(plan: BatchPlan, steps_per_epoch: int, num_samples: int,
                      max_steps: int, world_size: int) -> None:  # fmt: skip
    """Refuse a resume whose epochs would take another number of optimizer steps than the
    checkpoint's LR schedule was laid out for (the padding to a multiple of the world size can
    add a step where the data set ends near a multiple of the global batch).

    Raises:
        ConfigError: one line naming both step counts and the numbers of processes that keep it.
    """
    saved = ((plan.found[1].get("extra") or {}) if plan.found else {}).get("steps_per_epoch")
    if saved is None or saved == steps_per_epoch:
        return
    global_batch = plan.global_batch_size
    sizes = [m for m in world_sizes_for(global_batch)
             if epoch_steps(num_samples, m, global_batch, max_steps) == saved]  # fmt: skip
    raise ConfigError(
        f"cannot resume {plan.found[0]} on {world_size} process(es): steps_per_epoch="
        f"{steps_per_epoch} ({num_samples} samples padded to a multiple of {world_size}, in "
        f"global batches of {global_batch}), but its learning-rate schedule counts {saved} per "
        f"epoch. Resume with --nproc one of {', '.join(map(str, sizes)) or 'none'}, or start "
        "fresh without --resume."
    )
