"""The MNIST classifier of ``ddpkit train``: model, training loop, evaluation, outputs.

Run it (the launcher starts the ranks; this module is what each rank executes)::

    ddpkit train --nproc 2 --epochs 1 --data-dir ../shared/data/mnist
    torchrun --nproc-per-node 2 -m ddpkit train --epochs 1     # the same job, plain torchrun
"""

from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpkit.app.mnist.config import TrainConfig, check_step_options, resume_settings
from ddpkit.app.mnist.data import DataSource
from ddpkit.app.mnist.model import build_model, build_optimizer
from ddpkit.app.mnist.monitor import TrainingMonitor
from ddpkit.app.mnist.outputs import finite_or_none, reset_outputs
from ddpkit.checkpoint.manager import CheckpointManager
from ddpkit.distributed.process_group import Runtime
from ddpkit.distributed.sampler import build_eval_loader, build_train_loader
from ddpkit.errors import ConfigError
from ddpkit.files import write_json_atomic
from ddpkit.guards.nonfinite import NonFiniteError, NonFiniteGuard, check_replicas
from ddpkit.log import get_logger
from ddpkit.parallel.comm import CommStats
from ddpkit.parallel.local_sgd import enable_local_sgd
from ddpkit.parallel.wrap import model_state_dict, wrap_model
from ddpkit.training.accumulation import GradientAccumulator
from ddpkit.training.evaluate import evaluate
from ddpkit.training.loop import train_one_epoch
from ddpkit.training.observe import StepTimer
from ddpkit.training.precision import MixedPrecision

FAULT_ENV = "DDPKIT_FAULT_INJECT"


def build_model_and_optimizer(
    config: TrainConfig, runtime: Runtime, *, dataset: str = "mnist"
) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.Optimizer, CommStats | None]:
    """The wrapped CNN for ``dataset`` and its optimizer, with the config's wrap-time options.

    Collective: call on every rank (DDP broadcasts rank 0's parameters).

    Returns:
        ``(model, optimizer, inner_optimizer, comm_stats)``: ``optimizer`` is what the loop
        steps (a ``PostLocalSGDOptimizer`` with ``sync_every`` > 1), ``inner_optimizer`` the
        one an LR schedule drives; ``comm_stats`` counts gradient and averaging bytes (``None``
        for ``dp``, which has no DDP hook).
    """
    ddp_kwargs: dict = _ddp_options(config, runtime) if config.strategy != "dp" else {}
    if config.bucket_cap_mb is not None:
        ddp_kwargs["bucket_cap_mb"] = config.bucket_cap_mb
    if config.grad_as_bucket_view:
        ddp_kwargs["gradient_as_bucket_view"] = True
    stats = None if config.strategy == "dp" else CommStats()
    local_sgd = config.sync_every > 1
    # Without compression the gradients stay on DDP's built-in C++ all-reduce (the same path as
    # a hand-written DDP loop); the bytes are then counted per step, not by a Python hook.
    hooked = config.grad_compression != "none" and not local_sgd
    model = wrap_model(
        build_model(dataset),
        runtime,
        config.strategy,
        sync_batchnorm=config.sync_batchnorm,
        grad_compression=config.grad_compression,
        comm_stats=stats if hooked else None,
        powersgd_rank=config.powersgd_rank,
        powersgd_start_step=config.powersgd_start_step,
        **ddp_kwargs,
    )  # DDP when world_size > 1; replicas start equal
    inner = build_optimizer(config.optimizer, model.parameters(), config.lr)
    optimizer = inner
    if local_sgd:
        optimizer = enable_local_sgd(model, inner, runtime, config.sync_every, stats)
    elif stats is not None and not hooked and isinstance(model, DistributedDataParallel):
        stats.builtin_sync_bytes = sum(
            p.numel() * p.element_size() for p in model.parameters() if p.requires_grad
        )
    return model, optimizer, inner, stats


def _fault_injection(runtime: Runtime) -> int:
    """Step at which this rank kills itself, from ``DDPKIT_FAULT_INJECT=RANK:STEP`` (0 = never).

    A testing hook for restarts: it fires only in the first attempt (restart count 0).

    Raises:
        ConfigError: the variable is not ``RANK:STEP`` with a rank of this job.
    """
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return 0
    try:
        rank, step = (int(part) for part in spec.split(":"))
    except ValueError:
        rank = step = -1
    if not (0 <= rank < runtime.world_size and step > 0):
        raise ConfigError(
            f"invalid {FAULT_ENV}={spec!r}: expected RANK:STEP with 0 <= RANK < "
            f"{runtime.world_size} and STEP >= 1, e.g. 1:10. Unset it to train normally."
        )
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    return step if first_attempt and rank == runtime.rank else 0


def _ddp_options(config: TrainConfig, runtime: Runtime) -> dict:
    """DDP keyword arguments from the config (none at world size 1, where there is no DDP)."""
    if runtime.world_size == 1:
        return {}
    options = {"find_unused_parameters": config.find_unused_parameters}
    return {**options, "static_graph": config.static_graph}


def _comm_bytes(stats: CommStats | None) -> float:
    return math.nan if stats is None else float(stats.total_bytes)


def _per_step(num_bytes: float, num_steps: int) -> float:
    """Payload bytes all-reduced per optimizer step (NaN, i.e. null, when not counted)."""
    return num_bytes / num_steps if num_steps else math.nan


def train_mnist(config: TrainConfig, runtime: Runtime, source: DataSource) -> dict:
    """Train and evaluate the MNIST CNN with the runtime's strategy; rank 0 writes the outputs.

    A fresh run replaces the outputs (and checkpoints) of an earlier run in the same
    ``output_dir``, so a crash never leaves new metrics beside an old summary and a restart
    never resumes another run's checkpoint. A resumed run is checked against the checkpoint's
    settings *before* anything is removed, and keeps the metrics of its completed epochs.

    Collective: call on every rank with the same ``config`` and ``source``.

    Returns:
        The summary dict (also written to ``output_dir/summary.json`` by rank 0): test_accuracy
        (0..1), test_loss, test_samples, train_set_size, world_size, backend, epochs,
        final_step, samples_per_s (global training samples per second of this process's
        training time; after a resume, of the resumed part), wall_s, dataset,
        comm_bytes_per_step (gradient plus local-SGD averaging payload bytes each rank handed
        to all-reduce per optimizer step, counted by ddpkit's DDP comm hook; 0 for a single
        process, null for dp). Non-finite values (a diverged run) are written as ``null``.
    """
    log = get_logger("train")
    start = time.perf_counter()
    output_dir = Path(config.output_dir)
    kill_at = _fault_injection(runtime)
    check_step_options(config)
    torch.manual_seed(config.seed)
    train_set, test_set = source.load("train"), source.load("test")
    model, optimizer, inner_optimizer, comm_stats = build_model_and_optimizer(
        config, runtime, dataset=source.dataset
    )
    train_loader = build_train_loader(
        train_set,
        runtime,
        config.batch_size,
        seed=config.seed,
        max_batches=config.max_steps * config.grad_accum or None,
    )
    test_loader = build_eval_loader(test_set, runtime, batch_size=1000)
    precision = MixedPrecision(config.precision, runtime)
    accumulator = GradientAccumulator(model, runtime, config.grad_accum, precision)
    steps_per_epoch = accumulator.num_optimizer_steps(len(train_loader))  # optimizer steps
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        inner_optimizer, max_lr=config.lr, total_steps=steps_per_epoch * config.epochs
    )
    ckpt = CheckpointManager(
        output_dir / "checkpoints", runtime, every_steps=config.checkpoint_every
    )
    state = {
        "model": model,
        "optimizer": optimizer,
        "scheduler": schedule,
        "scaler": precision.scaler,
        "loader": train_loader,
    }
    settings = {**resume_settings(config), "dataset": source.dataset}
    step = 0
    if config.resume:
        path = None if config.resume == "auto" else config.resume
        step = ckpt.resume(**state, path=path, extra=settings)
        if path is None and step == 0:
            get_logger("train").info(
                "--resume auto: no complete checkpoint in %s, starting from step 0", ckpt.directory
            )
    reset_outputs(output_dir, runtime, train_loader.epoch if step else None, step)
    timer = StepTimer(runtime, enabled=config.step_timing)
    monitor = TrainingMonitor(
        output_dir, runtime, timer, inner_optimizer, step,
        config.log_every, config.progress, config.tensorboard,
    )  # fmt: skip
    guard = None if config.on_nonfinite == "off" else NonFiniteGuard(runtime, config.on_nonfinite)
    averager = optimizer.averager if optimizer is not inner_optimizer else None  # local SGD
    first_step = step

    def may_step(loss: torch.Tensor) -> bool:
        return guard is None or guard.check(step + 1, loss, model)

    def on_step() -> None:
        nonlocal step
        step += 1
        if comm_stats is not None:
            comm_stats.count_builtin_sync()  # the window's last backward synced (skipped or not)
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if config.check_replicas_every and step % config.check_replicas_every == 0:
            if averager is None or averager.just_averaged:  # local SGD: equal only then
                check_replicas(model, runtime, step)
        ckpt.maybe_save(step, **state, extra=settings)
        monitor.on_step(step)

    global_batch = config.batch_size * runtime.world_size * config.grad_accum
    log.info(
        "training %s on %d process(es), backend=%s, device=%s, %d train / %d test samples, "
        "global batch %d", source.dataset, runtime.world_size, runtime.backend or "none",
        runtime.device, len(train_set), len(test_set), global_batch,
    )  # fmt: skip
    log.info(
        "gradient sync: strategy %s, compression %s, %s, bucket cap %s",
        config.strategy, config.grad_compression,
        f"local SGD averaging every {config.sync_every} steps" if averager else "every step",
        "torch default" if config.bucket_cap_mb is None else f"{config.bucket_cap_mb} MiB",
    )  # fmt: skip
    train_time_s = samples_total = 0.0
    test = None
    try:
        while train_loader.epoch < config.epochs:
            epoch = train_loader.epoch + 1
            epoch_bytes, epoch_first_step = _comm_bytes(comm_stats), step
            monitor.start_epoch(epoch, config.epochs, train_loader)
            train_loss, num_samples, epoch_s = train_one_epoch(
                model, train_loader, optimizer, schedule, runtime, on_step, may_step,
                accumulator, config.clip_grad_norm, config.join, timer=timer,
            )  # fmt: skip
            monitor.close_bar()
            step_times = timer.epoch_summary(runtime)  # collective: one all-reduce
            if guard is None and not math.isfinite(train_loss):
                raise NonFiniteError(
                    f"epoch {epoch}: the mean train loss over all ranks is {train_loss}: "
                    "training diverged or the data holds NaN/Inf. Rerun with --on-nonfinite "
                    "raise to stop at the first such step and name the rank (or skip to drop "
                    "those steps); a lower --lr often helps."
                )
            if averager is not None and not averager.just_averaged:  # evaluate the averaged model
                averager.average_now(inner_optimizer.param_groups)
            train_time_s += epoch_s
            samples_total += num_samples
            test = evaluate(model, test_loader, runtime)
            record = {
                "epoch": epoch,
                "train_loss": train_loss,
                "test_loss": test["loss"],
                "test_accuracy": test["accuracy"],
                "test_samples": test["num_samples"],
                "samples_per_s": num_samples / epoch_s,
                "epoch_s": epoch_s,
                "comm_bytes_per_step": _per_step(
                    _comm_bytes(comm_stats) - epoch_bytes, step - epoch_first_step
                ),
                "step": step,
                **{k: v for k, v in step_times.items() if k.endswith("_per_step") or "memory" in k},
            }
            log.info(
                "epoch %d/%d  train_loss %.4f  test_loss %.4f  test_acc %.4f  %.0f samples/s",
                epoch, config.epochs, train_loss, test["loss"], test["accuracy"],
                record["samples_per_s"],
            )  # fmt: skip
            monitor.end_epoch(record, step)
    except KeyboardInterrupt:  # Ctrl-C: the launcher's one line names where it stopped (#16)
        epoch = step // max(steps_per_epoch, 1) + 1
        raise KeyboardInterrupt(f"after step {step} (epoch {epoch}/{config.epochs})") from None
    finally:
        monitor.close()
    if test is None:  # resumed from a checkpoint taken at the very end: evaluate it
        test = evaluate(model, test_loader, runtime)
    summary = {
        "test_accuracy": test["accuracy"],
        "test_loss": test["loss"],
        "test_samples": test["num_samples"],
        "train_set_size": len(train_set),
        "world_size": runtime.world_size,
        "backend": runtime.backend or "none",
        "epochs": config.epochs,
        "final_step": step,
        "samples_per_s": samples_total / train_time_s if train_time_s else math.nan,
        "wall_s": time.perf_counter() - start,
        "dataset": source.dataset,
        "comm_bytes_per_step": _per_step(_comm_bytes(comm_stats), step - first_step),
    }
    summary = {k: finite_or_none(v) if isinstance(v, float) else v for k, v in summary.items()}
    summary["config"] = asdict(config)
    if runtime.is_rank_zero:
        torch.save(model_state_dict(model), output_dir / ".model.pt.tmp")
        os.replace(output_dir / ".model.pt.tmp", output_dir / "model.pt")
        write_json_atomic(output_dir / "summary.json", summary)
        written = sorted(p.name for p in output_dir.iterdir() if not p.name.startswith("."))
        log.info(
            "wrote %s (%s); plot it with: ddpkit plot %s",
            output_dir,
            ", ".join(written),
            output_dir,
        )
    return summary
