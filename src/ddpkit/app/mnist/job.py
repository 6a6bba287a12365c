"""The MNIST classifier of ``ddpkit train``: model, training loop, evaluation, outputs.

Run it (the launcher starts the ranks; this module is what each rank executes)::

    ddpkit train --nproc 2 --epochs 1 --data-dir ../shared/data/mnist
    torchrun --nproc-per-node 2 -m ddpkit train --epochs 1     # the same job, plain torchrun
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpkit.app.mnist.config import TrainConfig, check
from ddpkit.app.mnist.data import DataSource
from ddpkit.app.mnist.epoch_meter import EpochMeter, coverage_note
from ddpkit.app.mnist.exporting import Exporters, exporter_settings
from ddpkit.app.mnist.goodput import Goodput, goodput_line
from ddpkit.app.mnist.model import build_model, build_optimizer, optimizer_spec
from ddpkit.app.mnist.monitor import TrainingMonitor
from ddpkit.app.mnist.outputs import checkpoint_folder, finite_or_none, reset_outputs
from ddpkit.app.mnist.resume import BatchPlan, checkpoint_settings, plan_batch
from ddpkit.app.mnist.schedule import LRStepper
from ddpkit.app.mnist.stopping import check_grace_period
from ddpkit.checkpoint.manager import CheckpointManager
from ddpkit.data.sampler import ShardedLoader, build_eval_loader, build_train_loader
from ddpkit.files import write_json_atomic
from ddpkit.guards.nonfinite import NonFiniteError, NonFiniteGuard, check_replicas
from ddpkit.log import get_logger
from ddpkit.monitoring.observe import StepTimer
from ddpkit.monitoring.stragglers import StragglerDetector
from ddpkit.parallel.comm import CommStats
from ddpkit.parallel.local_sgd import enable_local_sgd
from ddpkit.parallel.strategy import (
    DDP,
    FSDP,
    Auto,
    DataParallel,
    Single,
    Strategy,
    ZeRO1,
    strategy_class,
    wrapped_strategy,
)
from ddpkit.parallel.wrap import model_state_dict, wrap_model
from ddpkit.parallel.zero import build_zero_optimizer
from ddpkit.runtime.process_group import Runtime
from ddpkit.runtime.stop import TrainingStopped
from ddpkit.training.evaluate import evaluate
from ddpkit.training.loop import train_epoch
from ddpkit.training.precision import MixedPrecision
from ddpkit.training.step import TrainStep

if TYPE_CHECKING:
    from torch.distributed.optim import PostLocalSGDOptimizer


def build_model_and_optimizer(
    config: TrainConfig, runtime: Runtime, *, dataset: str = "mnist"
) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.Optimizer, CommStats | None]:
    """The wrapped CNN for ``dataset`` and its optimizer, with the config's wrap-time options.

    ``zero1``: the optimizer is a ``ZeroRedundancyOptimizer``; ``fsdp``: the model is sharded
    and its optimizer built over the shards (see :func:`_build_fsdp`). The strategy object is
    built from the config (:func:`strategy_of`).

    Collective: call on every rank (DDP broadcasts rank 0's parameters).

    Returns:
        ``(model, optimizer, inner_optimizer, comm_stats)``: ``optimizer`` is what the loop
        steps (a ``PostLocalSGDOptimizer`` with ``sync_every`` > 1), ``inner_optimizer`` the
        one an LR schedule drives; ``comm_stats`` counts gradient and averaging bytes (``None``
        for ``dp``, which has no DDP hook, and for ``fsdp``, whose collectives are FSDP's).
    """
    cls = strategy_class(config.strategy)
    if cls is FSDP:
        return _build_fsdp(config, runtime, dataset)
    stats = None if cls is DataParallel else CommStats()
    local_sgd = config.sync_every > 1
    # Without compression the gradients stay on DDP's built-in C++ all-reduce (the same path as
    # a hand-written DDP loop); the bytes are then counted per step, not by a Python hook.
    hooked = config.grad_compression != "none" and not local_sgd
    model = wrap_model(
        build_model(dataset),
        runtime,
        strategy=strategy_of(config, runtime, stats if hooked else None),
        compile=_compile(config),
    )  # DDP when world_size > 1; replicas start equal
    if isinstance(wrapped_strategy(model), ZeRO1):  # the optimizer state sharded over the ranks
        optimizer_class, kwargs = optimizer_spec(config.optimizer, config.lr)
        inner = build_zero_optimizer(
            model.parameters(), runtime, optimizer_class=optimizer_class, **kwargs
        )
    else:
        inner = build_optimizer(config.optimizer, model.parameters(), config.lr)
    optimizer = inner
    if local_sgd:
        optimizer = enable_local_sgd(
            model, inner, runtime=runtime, sync_every=config.sync_every, comm_stats=stats
        )
    elif (
        stats is not None
        and not hooked
        and (isinstance(model, DistributedDataParallel) or runtime.live is not None)
    ):  # DDP's own all-reduce, or live fault tolerance's (the same bytes, after backward)
        stats.builtin_sync_bytes = sum(
            p.numel() * p.element_size() for p in model.parameters() if p.requires_grad
        )
    return model, optimizer, inner, stats


def _build_fsdp(
    config: TrainConfig, runtime: Runtime, dataset: str
) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.Optimizer, CommStats | None]:
    """``--strategy fsdp``: each layer sharded (``fully_shard``), the optimizer over the shards
    (built after wrapping), FSDP's mixed precision from ``--precision``; no byte counter."""
    strategy = strategy_of(config, runtime)
    model = wrap_model(build_model(dataset), runtime, strategy=strategy, compile=_compile(config))
    optimizer = build_optimizer(config.optimizer, model.parameters(), config.lr)
    return model, optimizer, optimizer, None


def strategy_of(
    config: TrainConfig, runtime: Runtime, comm_stats: CommStats | None = None
) -> Strategy:
    """The strategy object of ``--strategy`` with the config's options for it (:func:`check`
    refused the options of another strategy); ``auto`` resolves in ``wrap_model``.
    ``comm_stats``: the counter of DDP's comm hook (``ddp``, ``zero1``, ``auto``)."""
    cls = strategy_class(config.strategy)
    if cls is FSDP:
        return FSDP(
            sync_batchnorm=config.sync_batchnorm,
            reshard_after_forward=config.reshard_after_forward,
            precision=config.precision,
        )
    if cls is DataParallel or cls is Single:
        return cls()
    ddp = ZeRO1 if cls is ZeRO1 else DDP
    strategy = ddp(
        sync_batchnorm=config.sync_batchnorm,
        grad_compression=config.grad_compression,
        comm_stats=comm_stats,
        powersgd_rank=config.powersgd_rank,
        powersgd_start_step=config.powersgd_start_step,
        **_ddp_options(config, runtime),
    )
    return Auto(ddp=strategy) if cls is Auto else strategy


def _compile(config: TrainConfig) -> dict[str, Any] | bool:
    """``wrap_model``'s ``compile`` of ``--compile``/``--compile-backend``."""
    return {"backend": config.compile_backend} if config.compile else False


def _ddp_options(config: TrainConfig, runtime: Runtime) -> dict[str, Any]:
    """DDP keyword arguments from the config (``find_unused_parameters`` and ``static_graph``:
    not at world size 1, where there is no DDP, nor with live fault tolerance, whose replicas
    are plain modules)."""
    options: dict[str, Any] = {}
    if runtime.world_size > 1 and runtime.live is None:
        options["find_unused_parameters"] = config.find_unused_parameters
        options["static_graph"] = config.static_graph
    if config.bucket_cap_mb is not None:
        options["bucket_cap_mb"] = config.bucket_cap_mb
    if config.grad_as_bucket_view:
        options["gradient_as_bucket_view"] = True
    return options


def _straggler_detector(config: TrainConfig, runtime: Runtime) -> StragglerDetector | bool:
    """``--straggler-window``/``--straggler-factor``'s detector (``False``: off)."""
    if not config.straggler_window:
        return False
    return StragglerDetector(
        runtime, window=config.straggler_window, factor=config.straggler_factor
    )


def _comm_bytes(stats: CommStats | None) -> float:
    return math.nan if stats is None else float(stats.total_bytes)


def _per_step(num_bytes: float, num_steps: int) -> float:
    """Payload bytes all-reduced per optimizer step (NaN, i.e. null, when not counted)."""
    return num_bytes / num_steps if num_steps else math.nan


@dataclass
class MnistTraining:
    """What :func:`train_mnist` builds before its first step (see :func:`build_training`).

    Attributes:
        model: the wrapped CNN.
        optimizer: what the step steps (a ``PostLocalSGDOptimizer`` with ``sync_every`` > 1).
        inner_optimizer: the optimizer the LR schedule drives.
        comm_stats: gradient and averaging bytes (``None`` for ``dp``).
        train_loader: this rank's shard, each pass capped at ``max_steps`` windows.
        test_loader: this rank's part of the test set (every sample counted once).
        precision: autocast, loss scaling and clipping (its scaler is checkpointed).
        schedule: the one-cycle LR schedule over every epoch's optimizer steps.
        ckpt: the checkpoint manager of ``output_dir/checkpoints``.
        state: the objects a checkpoint saves and a resume restores, by name.
        meter: the running figures of the current epoch (in ``state``: a resumed epoch's
            record covers the whole epoch).
        settings: the settings a resumed run must share with its checkpoint.
        num_train: training samples; num_test: test samples.
        lr_stepper: steps the schedule (:mod:`ddpkit.app.mnist.schedule`): by optimizer
            steps, or with live fault tolerance by the loader's position.
        goodput: this attempt's time split (:mod:`ddpkit.app.mnist.goodput`), once training
            starts.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    inner_optimizer: torch.optim.Optimizer
    comm_stats: CommStats | None
    train_loader: ShardedLoader
    test_loader: Any
    precision: MixedPrecision
    schedule: torch.optim.lr_scheduler.LRScheduler
    ckpt: CheckpointManager
    state: dict[str, Any]
    meter: EpochMeter
    settings: dict[str, Any]
    num_train: int
    num_test: int
    lr_stepper: LRStepper
    goodput: Goodput | None = None

    @property
    def averager(self) -> Any:
        """Local SGD's parameter averager, or ``None`` (gradients all-reduced every step)."""
        if self.optimizer is self.inner_optimizer:
            return None
        # build_model_and_optimizer wraps the inner optimizer only for local SGD
        return cast("PostLocalSGDOptimizer", self.optimizer).averager


def build_training(
    config: TrainConfig, runtime: Runtime, source: DataSource, *, plan: BatchPlan | None = None
) -> MnistTraining:
    """Data, wrapped model, optimizer, precision, LR schedule and checkpoint manager.

    ``config`` holds the per-rank batch and micro-steps this world size runs with; ``plan``
    (:func:`~ddpkit.app.mnist.resume.plan_batch`, default: ``config``'s own, a fresh start) the
    batch settings the checkpoints record.

    Collective: call on every rank (DDP's broadcast of rank 0's parameters).
    """
    torch.manual_seed(config.seed)
    train_set, test_set = source.load("train"), source.load("test")
    model, optimizer, inner_optimizer, comm_stats = build_model_and_optimizer(
        config, runtime, dataset=source.dataset
    )
    train_loader = build_train_loader(
        train_set,
        runtime,
        batch_size=config.batch_size,
        seed=config.seed,
        max_batches=config.max_steps * config.grad_accum or None,  # max_steps windows a pass
    )
    test_loader = build_eval_loader(test_set, runtime, batch_size=1000)
    precision = MixedPrecision(config.precision, runtime)
    steps_per_epoch = -(-len(train_loader) // config.grad_accum)  # optimizer steps: ceil
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        inner_optimizer, max_lr=config.lr, total_steps=steps_per_epoch * config.epochs
    )
    meter = EpochMeter()
    state = {
        "model": model,
        "optimizer": optimizer,
        "scheduler": schedule,
        "scaler": precision.scaler,
        "loader": train_loader,
        "epoch_metrics": meter,
    }
    if plan is None:
        requested = (config.batch_size, config.grad_accum)
        plan = BatchPlan(*requested, requested[0] * requested[1] * runtime.world_size, requested)
    settings = checkpoint_settings(config, source.dataset, plan)
    ckpt = CheckpointManager(
        checkpoint_folder(config.output_dir),
        runtime,
        state=state,
        every_steps=config.checkpoint_every,
        extra=settings,
        async_save=config.async_checkpoint,
        unsafe_pickle=config.unsafe_pickle,
    )
    return MnistTraining(
        model,
        optimizer,
        inner_optimizer,
        comm_stats,
        train_loader,
        test_loader,
        precision,
        schedule,
        ckpt,
        state,
        meter,
        settings,
        len(train_set),
        len(test_set),
        LRStepper(schedule, config.epochs if runtime.live is not None else None),
    )


def _resume(config: TrainConfig, job: MnistTraining, plan: BatchPlan) -> int:
    """The step ``--resume`` restored (0: a fresh start). Collective: call on every rank."""
    live = job.ckpt.runtime.live
    if live is not None and live.quorum is None:  # a live replacement: healed from a peer
        return job.ckpt.resume()
    if not config.resume:
        return 0
    if plan.note:
        get_logger("train").info(plan.note)
    path = None if config.resume == "auto" else config.resume
    step = job.ckpt.resume(path)
    if path is None and step == 0:
        get_logger("train").info(
            "--resume auto: no complete checkpoint in %s, starting from step 0", job.ckpt.directory
        )
    return step


def _log_setup(config: TrainConfig, runtime: Runtime, dataset: str, job: MnistTraining) -> None:
    log = get_logger("train")
    global_batch = config.batch_size * runtime.world_size * config.grad_accum
    log.info(
        "training %s on %d process(es), backend=%s, device=%s, %d train / %d test samples, "
        "global batch %d",
        dataset,
        runtime.world_size,
        runtime.backend or "none",
        runtime.device,
        job.num_train,
        job.num_test,
        global_batch,
    )
    log.info(
        "gradient sync: strategy %s, compression %s, %s, bucket cap %s%s",
        config.strategy,
        config.grad_compression,
        f"local SGD averaging every {config.sync_every} steps" if job.averager else "every step",
        "torch default" if config.bucket_cap_mb is None else f"{config.bucket_cap_mb} MiB",
        f", torch.compile backend {config.compile_backend}" if config.compile else "",
    )


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
        training time; after a resume, of the epochs this process finished, an epoch resumed
        inside counted whole), wall_s (of this process), dataset,
        comm_bytes_per_step (gradient plus local-SGD averaging payload bytes each rank handed
        to all-reduce per optimizer step, counted by ddpkit's DDP comm hook; 0 for a single
        process, null for dp and fsdp; for zero1 the gradient all-reduce only, not ZeRO's
        parameter broadcast). Non-finite values (a diverged run) are written as ``null``.
    """
    start = time.perf_counter()
    output_dir = Path(config.output_dir)
    check(config, world_size=runtime.world_size)
    plan = plan_batch(config, runtime.world_size)  # a resume keeps its global batch
    config = dataclasses.replace(config, batch_size=plan.batch_size, grad_accum=plan.grad_accum)
    check(config, world_size=runtime.world_size)
    job = build_training(config, runtime, source, plan=plan)
    replacement = runtime.live is not None and runtime.live.quorum is None
    first_step = _resume(config, job, plan)
    if not replacement:  # a live replacement joins a running job: its outputs stand
        epoch = job.train_loader.epoch if first_step else None
        reset_outputs(output_dir, runtime, epoch, first_step)
    train_step, monitor = _build_step(config, runtime, job, first_step)
    with monitor.exporters.closed_on_error():  # tracker runs end FAILED, never RUNNING
        _log_setup(config, runtime, source.dataset, job)
        check_grace_period(job.ckpt, runtime)
        job.goodput = Goodput(output_dir, runtime, first_step)
        with _where_it_stopped(config, job, train_step, monitor):
            job.ckpt.maybe_save(first_step)  # a stop signal now waits for a step boundary
            test, train_time_s, samples_total = _train_epochs(
                config, runtime, job, train_step, monitor
            )
        job.ckpt.wait()  # --async-checkpoint: the last save committed (a no-op otherwise)
        if test is None:  # resumed from a checkpoint taken at the very end: evaluate it
            test = evaluate(job.model, job.test_loader, runtime)
        summary = _summary(
            config,
            runtime,
            job,
            train_step,
            test=test,
            dataset=source.dataset,
            first_step=first_step,
            wall_s=time.perf_counter() - start,
            samples_per_s=samples_total / train_time_s if train_time_s else math.nan,
        )
        summary["goodput"] = job.goodput.finish("completed", job.ckpt.save_s)
        summary["config"] = asdict(config)
        if summary["goodput"]:
            get_logger("train").info(goodput_line(summary["goodput"]))
        _write_outputs(output_dir, runtime, job.model, summary)
        monitor.exporters.finish(summary)
    return summary


def _summary(
    config: TrainConfig,
    runtime: Runtime,
    job: MnistTraining,
    train_step: TrainStep,
    *,
    test: dict,
    dataset: str,
    first_step: int,
    wall_s: float,
    samples_per_s: float,
) -> dict[str, Any]:
    """``summary.json`` before its goodput and config (see :func:`train_mnist`)."""
    summary = {
        "test_accuracy": test["accuracy"],
        "test_loss": test["loss"],
        "test_samples": test["num_samples"],
        "train_set_size": job.num_train,
        "world_size": runtime.world_size,
        "backend": runtime.backend or "none",
        "epochs": config.epochs,
        "final_step": train_step.num_steps,
        "samples_per_s": samples_per_s,
        "wall_s": wall_s,
        "dataset": dataset,
        "comm_bytes_per_step": _per_step(
            _comm_bytes(job.comm_stats), train_step.num_steps - first_step
        ),
    }
    summary = {k: finite_or_none(v) if isinstance(v, float) else v for k, v in summary.items()}
    stragglers = train_step.stragglers
    summary["stragglers"] = stragglers.summary() if stragglers is not None else None
    return summary


def _build_step(
    config: TrainConfig, runtime: Runtime, job: MnistTraining, first_step: int
) -> tuple[TrainStep, TrainingMonitor]:
    """The step (timer, non-finite guard, straggler detector) and what watches it (records,
    progress bar, TensorBoard, the Prometheus endpoint and trackers when asked for)."""
    timer = StepTimer(runtime, enabled=config.step_timing)
    guard = None if config.on_nonfinite == "off" else NonFiniteGuard(runtime, config.on_nonfinite)
    train_step = TrainStep(
        job.model,
        job.optimizer,
        runtime=runtime,
        num_micro_steps=config.grad_accum,
        precision=job.precision,
        clip_grad_norm=config.clip_grad_norm,
        guard=guard,
        timer=timer,
        start_step=first_step,
        stragglers=_straggler_detector(config, runtime),
    )
    output_dir = Path(config.output_dir)
    monitor = TrainingMonitor(
        output_dir,
        runtime,
        timer,
        job.inner_optimizer,
        first_step,
        config.log_every,
        config.progress,
        config.tensorboard,
        exporters=Exporters(runtime, output_dir, **exporter_settings(config)),
    )
    monitor.watch_ranks(train_step.stragglers)
    return train_step, monitor


@contextlib.contextmanager
def _where_it_stopped(
    config: TrainConfig, job: MnistTraining, train_step: TrainStep, monitor: TrainingMonitor
) -> Iterator[None]:
    """A stop signal's (#14) or Ctrl-C's (#16) step and epoch, for the launcher's one line;
    the tracker runs of a stopped job end as KILLED (any other error: FAILED, by
    ``Exporters.closed_on_error`` around the whole job)."""
    goodput = job.goodput
    assert goodput is not None  # train_mnist sets it before training
    try:
        yield
    except TrainingStopped as stopped:
        stopped.note = _epoch_note(config, job, train_step)
        goodput.finish("stopped", job.ckpt.save_s)
        monitor.exporters.close("KILLED")
        raise
    except KeyboardInterrupt:
        note = _epoch_note(config, job, train_step)
        monitor.exporters.close("KILLED")
        raise KeyboardInterrupt(f"after step {train_step.num_steps} {note}") from None
    finally:
        monitor.close()


def _epoch_note(config: TrainConfig, job: MnistTraining, train_step: TrainStep) -> str:
    """``"(epoch 2/5)"``: the epoch the current step is in."""
    per_epoch = max(train_step.num_optimizer_steps(len(job.train_loader)), 1)
    return f"(epoch {max(train_step.num_steps - 1, 0) // per_epoch + 1}/{config.epochs})"


def _train_epochs(
    config: TrainConfig,
    runtime: Runtime,
    job: MnistTraining,
    train_step: TrainStep,
    monitor: TrainingMonitor,
) -> tuple[dict | None, float, float]:
    """The remaining epochs, each evaluated and recorded; returns ``(last test metrics, training
    seconds, training samples)``. Collective: call on every rank."""
    goodput = job.goodput
    assert goodput is not None  # train_mnist sets it before training
    train_time_s = samples_total = 0.0
    test = None
    while job.train_loader.epoch < config.epochs:
        epoch = job.train_loader.epoch + 1
        epoch_bytes, epoch_first_step = _comm_bytes(job.comm_stats), train_step.num_steps
        monitor.start_epoch(epoch, config.epochs, job.train_loader)
        figures = _train_one_epoch(config, runtime, job, train_step, monitor)
        train_loss, num_samples = figures["train_loss"], figures["num_samples"]
        epoch_s = figures["epoch_s"]  # training seconds of the epoch, across a restart
        monitor.close_bar()
        step_times = train_step.timer.epoch_summary(runtime)  # collective: one all-reduce
        _check_finite(train_loss, epoch, guarded=train_step.guard is not None)
        if job.averager is not None and not job.averager.just_averaged:  # evaluate the average
            job.averager.average_now(job.inner_optimizer.param_groups)
        train_time_s += epoch_s
        samples_total += num_samples
        eval_start = time.perf_counter()
        test = evaluate(job.model, job.test_loader, runtime)
        goodput.add_evaluation(time.perf_counter() - eval_start)
        record = {
            "epoch": epoch,
            "train_loss": train_loss,
            "test_loss": test["loss"],
            "test_accuracy": test["accuracy"],
            "test_samples": test["num_samples"],
            "train_samples": num_samples,
            "samples_per_s": num_samples / epoch_s,
            "epoch_s": epoch_s,
            "comm_bytes_per_step": _per_step(
                _comm_bytes(job.comm_stats) - epoch_bytes, train_step.num_steps - epoch_first_step
            ),
            "step": train_step.num_steps,
            **{k: v for k, v in step_times.items() if k.endswith("_per_step") or "memory" in k},
            "resumed_at_step": figures["resumed_at_step"],  # train_loss...epoch_s: whole epoch
            "whole_epoch": figures["whole_epoch"],
        }
        _log_epoch(record, config.epochs, coverage_note(figures, train_step.num_steps))
        monitor.end_epoch(record, train_step.num_steps, goodput=goodput.so_far())
    return test, train_time_s, samples_total


def _train_one_epoch(
    config: TrainConfig,
    runtime: Runtime,
    job: MnistTraining,
    train_step: TrainStep,
    monitor: TrainingMonitor,
) -> dict[str, Any]:
    """One pass (after a resume: the rest of it), step by step; returns the whole epoch's
    figures (:meth:`EpochMeter.finish`). Collective: call on every rank."""
    model, comm_stats, averager, meter = job.model, job.comm_stats, job.averager, job.meter
    goodput = job.goodput
    assert goodput is not None  # train_mnist sets it before training
    meter.start(job.train_loader.epoch + 1, train_step.num_steps)
    goodput.start_steps()
    for result in train_epoch(train_step, job.train_loader, join=config.join):
        step = result.step
        position = job.train_loader.state_dict() if job.lr_stepper.by_position else {}
        job.lr_stepper.step(result, position)
        meter.add(result)
        if comm_stats is not None:
            comm_stats.count_builtin_sync()  # the last backward synced (skipped or not)
        if config.check_replicas_every and step % config.check_replicas_every == 0:
            if averager is None or averager.just_averaged:  # local SGD: equal only then
                check_replicas(model, runtime, step=step)
        goodput.on_step(step, job.ckpt.save_s)  # the step is trained: record it first
        job.ckpt.maybe_save(step)  # also at a step the ranks agreed to stop at (a signal);
        # every save first folds the ranks' epoch sums (EpochMeter.before_checkpoint)
        monitor.on_step(step, result)
    return meter.finish(runtime, train_step.num_steps)  # collective


def _check_finite(train_loss: float, epoch: int, *, guarded: bool) -> None:
    """Without the non-finite guard, a NaN/Inf epoch loss ends the run with the fix.

    Raises:
        NonFiniteError: ``train_loss`` is NaN or infinite and no guard ran.
    """
    if guarded or math.isfinite(train_loss):
        return
    raise NonFiniteError(
        f"epoch {epoch}: the mean train loss over all ranks is {train_loss}: "
        "training diverged or the data holds NaN/Inf. Rerun with --on-nonfinite "
        "raise to stop at the first such step and name the rank (or skip to drop "
        "those steps); a lower --lr often helps."
    )


def _log_epoch(record: dict, num_epochs: int, note: str) -> None:
    get_logger("train").info(
        "epoch %d/%d  train_loss %.4f  test_loss %.4f  test_acc %.4f  %.0f samples/s%s",
        record["epoch"],
        num_epochs,
        record["train_loss"],
        record["test_loss"],
        record["test_accuracy"],
        record["samples_per_s"],
        note,
    )


def _write_outputs(output_dir: Path, runtime: Runtime, model: nn.Module, summary: dict) -> None:
    """Rank 0 writes ``model.pt`` and ``summary.json`` atomically and logs what is there.

    Collective for ``fsdp`` (the full state dict is gathered to rank 0): call on every rank.
    """
    state = model_state_dict(model)
    if not runtime.is_rank_zero:
        return
    torch.save(state, output_dir / ".model.pt.tmp")
    os.replace(output_dir / ".model.pt.tmp", output_dir / "model.pt")
    write_json_atomic(output_dir / "summary.json", summary)
    written = sorted(p.name for p in output_dir.iterdir() if not p.name.startswith("."))
    get_logger("train").info(
        "wrote %s (%s); plot it with: ddpkit plot %s", output_dir, ", ".join(written), output_dir
    )
