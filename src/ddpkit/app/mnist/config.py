"""The settings of ``ddpkit train`` (one :class:`TrainConfig`) and their cross-field checks."""

from __future__ import annotations

from dataclasses import dataclass

from ddpkit.errors import ConfigError


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one training job (the ``ddpkit train`` flags).

    Attributes:
        epochs: passes over the training set.
        batch_size: samples per rank per step (global batch = batch_size * world_size).
        lr: peak learning rate of the one-cycle schedule.
        optimizer: ``adam``, ``adamw`` or ``sgd`` (momentum 0.9).
        seed: seeds the model initialisation and the shuffle; the same on every rank.
        output_dir: where metrics.jsonl, summary.json and model.pt are written (rank 0 only).
        max_steps: stop each epoch after this many steps (0 = no limit); for quick checks.
        checkpoint_every: save a checkpoint to ``output_dir/checkpoints`` every this many
            optimizer steps (0 = never).
        resume: ``""`` (start fresh), ``"auto"`` (the newest complete checkpoint, if any) or the
            path of a checkpoint folder.
        on_nonfinite: ``raise`` (every rank stops, naming the rank and step), ``skip`` (every
            rank skips that step) or ``off`` (no check, the default) for a NaN/Inf loss or
            gradient.
        check_replicas_every: compare parameter checksums across ranks every this many steps
            (0 = never); raises naming the rank and parameters that differ. With
            ``sync_every`` > 1 it must be a multiple of it (checked right after averaging).
        strategy: ``auto`` (ddp for several processes, else single), ``single``, ``ddp`` or
            ``dp`` (DataParallel over 2+ GPUs in one process; ddp is recommended).
        bucket_cap_mb: DDP gradient bucket size in MiB (``None``: torch's default, 25 MiB
            with a 1 MiB first bucket).
        grad_as_bucket_view: gradients are views into DDP's buckets (saves one copy and
            the memory of the gradients).
        grad_compression: ``none``, ``fp16``, ``bf16`` or ``powersgd``: how DDP all-reduces
            gradients (torch's comm hooks).
        powersgd_rank: rank of PowerSGD's low-rank factors.
        powersgd_start_step: optimizer steps with plain all-reduce before PowerSGD starts.
        sync_every: H; 1 = all-reduce gradients every step (plain DDP); H >= 2 = local SGD,
            parameters averaged every H steps and at the end of each epoch.
        sync_batchnorm: convert BatchNorm layers to synchronised ones (the MNIST CNN has none:
            a no-op, with a log line).
        grad_accum: micro-batches per optimizer step (K >= 1); forward and backward of the
            first K-1 run without gradient sync; the loss is the mean over the global batch
            of the K micro-batches of every rank. Steps (``max_steps``, ``checkpoint_every``,
            the LR schedule) count optimizer steps.
        precision: ``32``, ``bf16-mixed`` (autocast to bfloat16) or ``16-mixed`` (float16
            autocast with a GradScaler whose skip decisions every rank shares).
        clip_grad_norm: clip the total L2 norm of the unscaled gradients to this before each
            optimizer step (0 = off).
        find_unused_parameters: DDP's option for models whose forward skips parameters on
            some steps (a graph traversal per step).
        static_graph: DDP's option for models whose set of used parameters never changes.
        join: train each epoch inside torch's ``Join`` (ranks may have different numbers of
            batches); the ``ddpkit train`` loader is even anyway, so this only adds Join's
            bookkeeping: two small all-reduces per forward (torch 2.13's DDP).
        step_timing: split each step's time into data wait, forward, backward (with DDP's
            overlapped all-reduce) and optimizer (:class:`~ddpkit.StepTimer`); each epoch
            record gets ``<phase>_s_per_step`` (seconds). Free on CPU; on CUDA it
            synchronizes the device at each phase boundary.
        log_every: write a step record (loss, global samples/s, lr) to steps.jsonl/csv
            every this many optimizer steps (0 = none).
        progress: ``auto`` (a rank-0 progress bar when stderr is a terminal), ``on``, ``off``.
        tensorboard: ``auto`` (event files in ``output_dir/tensorboard`` when the
            ``tensorboard`` package is installed) or ``off``.
    """

    epochs: int = 1
    batch_size: int = 64
    lr: float = 3e-3
    optimizer: str = "adam"
    seed: int = 0
    output_dir: str = "runs/mnist"
    max_steps: int = 0
    checkpoint_every: int = 0
    resume: str = ""
    on_nonfinite: str = "off"
    check_replicas_every: int = 0
    # wrap-time options: strategy, gradient communication, local SGD, sync batch norm
    strategy: str = "auto"
    bucket_cap_mb: float | None = None
    grad_as_bucket_view: bool = False
    grad_compression: str = "none"
    powersgd_rank: int = 1
    powersgd_start_step: int = 10
    sync_every: int = 1
    sync_batchnorm: bool = False
    # training step (issue 3: accumulation, precision, dynamic models, uneven inputs)
    grad_accum: int = 1
    precision: str = "32"
    clip_grad_norm: float = 0.0
    find_unused_parameters: bool = False
    static_graph: bool = False
    join: bool = False
    # observability (issue 7)
    step_timing: bool = True
    log_every: int = 50
    progress: str = "auto"
    tensorboard: str = "auto"


def resume_settings(config: TrainConfig) -> dict:
    """The settings a resumed run must share with its checkpoint (saved in the manifest)."""
    keys = ("epochs", "batch_size", "lr", "optimizer", "seed", "max_steps", "sync_every")
    # (a checkpoint written before grad_accum/precision existed lacks them and is not refused)
    return {key: getattr(config, key) for key in (*keys, "grad_accum", "precision")}


def check_step_options(config: TrainConfig) -> None:
    """Refuse option combinations of the training step that cannot work together.

    Raises:
        ConfigError: ``16-mixed`` with the non-finite guard (the GradScaler owns inf/NaN
            gradients: it skips those steps on every rank and lowers the scale).
    """
    if config.precision == "16-mixed" and config.on_nonfinite != "off":
        raise ConfigError(
            f"precision=16-mixed with on_nonfinite={config.on_nonfinite!r}: the GradScaler "
            "already skips steps whose gradients overflow (on every rank) and lowers the scale. "
            "Use on_nonfinite='off' (--on-nonfinite off) with 16-mixed."
        )
