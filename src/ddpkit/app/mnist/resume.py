"""Resuming ``ddpkit train``: the checkpoint it continues, how it splits the global batch on
this number of processes, and (after Ctrl-C) the command that continues it."""

from __future__ import annotations

import dataclasses
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from ddpkit.app.mnist.config import TrainConfig, resume_settings
from ddpkit.app.mnist.outputs import checkpoint_folder
from ddpkit.checkpoint.io import read_manifest
from ddpkit.checkpoint.manager import newest_manifest
from ddpkit.checkpoint.sharded import layout_refusal
from ddpkit.data.resize import fit_global_batch
from ddpkit.errors import ConfigError
from ddpkit.launch.stopping import kept_checkpoint, stop_label
from ddpkit.runtime.stop import TrainingStopped


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
        >>> interrupted_note("/nonexistent", ["train"])  # doctest: +NORMALIZE_WHITESPACE
        '; no checkpoint saved (--checkpoint-every N saves them): rerun with --overwrite to
        start again at step 0'
    """
    found = newest_manifest(checkpoint_folder(output_dir))
    if found is None:
        return (
            "; no checkpoint saved (--checkpoint-every N saves them): rerun with --overwrite "
            "to start again at step 0"
        )
    folder = found[0]
    command = shlex.join(["ddpkit", *without_resume(argv), "--resume", "auto"])
    return f"{kept_checkpoint(folder, saved=saved)}; resume with: {command}"


def resume_note(output_dir: str | os.PathLike[str], argv: list[str]) -> str:
    """After a failure: ``"the newest complete checkpoint is step-N in DIR; resume with: ddpkit
    train ... --resume auto"``, or ``""`` when the run has no checkpoint."""
    if newest_manifest(checkpoint_folder(output_dir)) is None:
        return ""
    return interrupted_note(output_dir, argv, saved=False).removeprefix("; ")


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
        return newest_manifest(checkpoint_folder(config.output_dir))
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


# what each strategy's model and optimizer load as (ddpkit.checkpoint.sharded.layout_of)
STRATEGY_LAYOUTS = {
    "fsdp": {
        "model": ("fsdp_model", "an FSDP model"),
        "optimizer": ("fsdp_optimizer", "an optimizer over FSDP shards"),
    },
    "zero1": {"optimizer": ("zero_optimizer", "a ZeroRedundancyOptimizer")},
}


def check_strategy(config: TrainConfig, plan: BatchPlan) -> None:
    """Refuse, before any worker starts, a resume whose ``--strategy`` cannot load the
    checkpoint's model or optimizer (an FSDP model from an unsharded one, a ZeRO optimizer from
    FSDP shards, ...): the rule of :func:`ddpkit.checkpoint.sharded.layout_refusal`, from the
    manifest alone. Not a collective.

    Raises:
        ConfigError: names the entry, both layouts and the fix.
    """
    if plan.found is None:
        return
    folder, manifest = plan.found
    saved = manifest.get("sharded") or {}
    layouts = STRATEGY_LAYOUTS.get(config.strategy, {})
    for name, default in (
        ("model", ("module", "a model")),
        ("optimizer", ("other", "an optimizer")),
    ):
        job, what = layouts.get(name, default)
        problem = layout_refusal(
            folder, name, saved.get(name), job, f"{what} (--strategy {config.strategy})"
        )
        if problem:
            raise ConfigError(problem)


def check_written_by_train(folder: Path, manifest: dict) -> None:
    """Refuse, before launch, a checkpoint another program wrote (its own loop's, say): its
    manifest records none of the settings every ``ddpkit train`` checkpoint records.

    Raises:
        ConfigError: names the checkpoint and what to do.
    """
    if "batch_size" not in (manifest.get("extra") or {}):
        raise ConfigError(
            f"checkpoint {folder} was not written by ddpkit train: its manifest records none of "
            "ddpkit train's settings (batch size, lr, epochs, ...). Resume it with the program "
            "that wrote it, or start fresh without --resume."
        )


def checkpoint_settings(config: TrainConfig, dataset: str, plan: BatchPlan) -> dict:
    """The settings a checkpoint of this run records and a resume must share: the config's
    ``resume=True`` fields with the batch settings the run was started with, the data set and
    the global batch.

    The global batch also fixes the LR schedule's steps per epoch on every world size that
    splits it: ``DistributedSampler`` pads N samples to the next multiple of the world size M,
    which never passes the next multiple of the global batch G when M divides G, so an epoch
    takes ``ceil(N / G)`` optimizer steps (``--max-steps`` capping it) on any of them.
    """
    settings = {**resume_settings(config), "dataset": dataset}
    settings.update(
        batch_size=plan.requested[0],
        grad_accum=plan.requested[1],
        global_batch_size=plan.global_batch_size,
    )
    return settings


def stop_note(stopped: TrainingStopped, output_dir: str | os.PathLike[str], argv: list[str]) -> str:
    """The one line of a ``ddpkit train`` that trained in this process (one process, or plain
    torchrun) and stopped on a signal: where, the checkpoint, how to resume.

    ``argv``: the user's ``ddpkit`` arguments (``[]`` under torchrun or srun, whose command ddpkit
    does not know: the line says to rerun it with ``--resume auto``).
    """
    where = (
        "at once (a second signal)"
        if stopped.now
        else f"after step {stopped.step} {stopped.note}".rstrip()
    )
    if argv:
        note = interrupted_note(output_dir, argv, saved=stopped.saved)
    else:
        found = newest_manifest(checkpoint_folder(output_dir))
        kept = kept_checkpoint(found[0], saved=stopped.saved) if found else "; no checkpoint"
        launcher = "srun" if "SLURM_JOB_ID" in os.environ else "torchrun"
        note = f"{kept}; resume: rerun the same {launcher} command with --resume auto"
    return f"ddpkit train: {stop_label(stopped.signal)} {where}{note}"
