"""Watching ``ddpkit train``: the rank-0 progress bar, step and epoch records, TensorBoard.

:class:`TrainingMonitor` composes the pieces ``train_mnist`` feeds at each optimizer step and
epoch end; each piece is also usable alone (:func:`progress_bar`, :func:`open_tensorboard`,
:func:`~ddpkit.app.mnist.outputs.append_record`).
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ddpkit.app.mnist.choices import PROGRESS_MODES, TENSORBOARD_MODES  # noqa: F401 (re-exported)
from ddpkit.app.mnist.exporting import Exporters
from ddpkit.app.mnist.outputs import append_record
from ddpkit.data.sampler import ShardedLoader
from ddpkit.log import get_logger
from ddpkit.monitoring.observe import StepTimer
from ddpkit.monitoring.stragglers import RankWindow, StragglerDetector
from ddpkit.runtime.collectives import all_reduce_sum
from ddpkit.runtime.process_group import Runtime
from ddpkit.training.device_values import DeviceSum, sequential_sum
from ddpkit.training.step import StepResult

_NOT_SCALARS = ("step", "epoch", "resumed_at_step")  # record keys that are no curve


def progress_bar(runtime: Runtime, total: int, mode: str = "auto", desc: str = "") -> Any:
    """A tqdm bar of global samples on rank 0 (samples/s and ETA); disabled on other ranks.

    Args:
        runtime: the job's :class:`~ddpkit.Runtime`.
        total: samples the bar counts to (over all ranks).
        mode: ``auto`` (shown when stderr is a terminal: tqdm's ``disable=None``), ``on`` or
            ``off``.
        desc: the bar's label, e.g. ``"epoch 1/3"``.

    Raises:
        ValueError: unknown ``mode``.
    """
    from tqdm import tqdm

    if mode not in PROGRESS_MODES:
        raise ValueError(f"unknown progress mode={mode!r}. Allowed: {', '.join(PROGRESS_MODES)}.")
    disable = None if mode == "auto" else mode == "off"
    return tqdm(
        total=total,
        desc=desc,
        unit=" samples",
        file=sys.stderr,
        leave=False,
        dynamic_ncols=True,
        disable=disable if runtime.is_rank_zero else True,
    )


def open_tensorboard(output_dir: Path, runtime: Runtime, mode: str, purge_step: int | None):
    """A ``torch.utils.tensorboard.SummaryWriter`` on ``output_dir/tensorboard`` (rank 0).

    ``purge_step``: a resumed run drops the events at or after this step that the interrupted
    run wrote past its checkpoint. Returns ``None`` on other ranks, with ``mode="off"``, or when
    ``tensorboard`` is not installed (rank 0 then logs one info line saying so).
    """
    if mode == "off" or not runtime.is_rank_zero:
        return None
    try:
        import tensorboard  # noqa: F401  (torch.utils.tensorboard needs it)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        get_logger("train").info(
            "TensorBoard is not installed: no event files "
            "(pip install 'ddpkit[tensorboard]' to get them)"
        )
        return None
    return SummaryWriter(log_dir=str(output_dir / "tensorboard"), purge_step=purge_step)


def remaining_samples(loader: ShardedLoader) -> int:
    """Global samples the loader's next pass yields (after a resume: what is left of it)."""
    return loader.next_pass_size()[1] or 0


class TrainingMonitor:
    """Progress bar, step records every ``log_every`` steps, epoch records, TensorBoard scalars.

    Rank 0 writes ``steps.jsonl``/``steps.csv`` (``step``, ``epoch``, ``loss``: mean over all
    ranks' samples of the steps since the last record, ``samples_per_s``: global samples per
    second over those steps, ``lr``) and ``metrics.jsonl``/``metrics.csv`` (the epoch records).
    TensorBoard scalars use the optimizer step as their x axis.

    Collective: call :meth:`on_step` on every rank after every optimizer step (one all-reduce
    of two floats every ``log_every`` steps).
    """

    def __init__(
        self,
        output_dir: Path,
        runtime: Runtime,
        timer: StepTimer,
        optimizer: torch.optim.Optimizer,
        first_step: int,
        log_every: int = 50,
        progress: str = "auto",
        tensorboard: str = "auto",
        exporters: Exporters | None = None,
    ) -> None:
        self.output_dir = output_dir
        self.runtime = runtime
        self.timer = timer
        self.optimizer = optimizer
        self.log_every = log_every
        self.progress = progress
        self.writer = open_tensorboard(
            output_dir, runtime, tensorboard, first_step + 1 if first_step else None
        )
        self.exporters = exporters or Exporters.off(runtime)
        self.bar: Any = None
        self.epoch = 0
        # this rank's loss sum (on the device: read once per record) and samples since the last
        self._since_loss, self._since_samples = DeviceSum(), 0.0
        self._log_mark = (time.perf_counter(), 0)  # (time, timer.num_samples) at the last record

    def watch_ranks(self, detector: StragglerDetector | None) -> None:
        """Rank 0 appends each straggler window's per-rank figures to ``ranks.jsonl``/``.csv``
        (one record per rank: ``step``, ``rank``, ``host``, ``data_s``, ``compute_s``,
        ``comm_wait_s``, ``step_s``: median seconds per step; ``samples_per_s``)."""
        self.exporters.watch(detector)
        if detector is None or not self.runtime.is_rank_zero:
            return
        detector.listeners.append(self._rank_records)

    def _rank_records(self, ranks: list[RankWindow]) -> None:
        for rank in ranks:
            record = {key: value for key, value in asdict(rank).items() if key != "last_step_time"}
            append_record(self.output_dir, "ranks", {"step": record.pop("step"), **record})

    def start_epoch(self, epoch: int, num_epochs: int, loader: ShardedLoader) -> None:
        """Open the epoch's progress bar (rank 0) before the epoch's first step."""
        self.epoch = epoch
        total = remaining_samples(loader)
        self.bar = progress_bar(self.runtime, total, self.progress, f"epoch {epoch}/{num_epochs}")
        self._log_mark = (time.perf_counter(), 0)

    def on_step(self, step: int, result: StepResult) -> None:
        """After optimizer step ``step`` (its ``result``): advance the bar; every ``log_every``
        steps, a record.

        Collective: call on every rank (the record's loss is all-reduced).
        """
        timer = self.timer
        self.exporters.on_step(result)
        self._since_loss.add(sequential_sum(result.loss_sums_tensor))  # += result.loss_sum
        self._since_samples += result.num_samples
        if self.bar is not None:
            self.bar.update(timer.num_samples - self.bar.n)
        if not self.log_every or step % self.log_every:
            return
        since = [self._since_loss.value(), self._since_samples]  # the interval's one read
        loss_sum, num_samples = all_reduce_sum(since, self.runtime).tolist()
        now = time.perf_counter()
        mark_time, mark_samples = self._log_mark
        record = {
            "step": step,
            "epoch": self.epoch,
            "loss": loss_sum / max(num_samples, 1.0),
            "samples_per_s": (timer.num_samples - mark_samples) / max(now - mark_time, 1e-9),
            "lr": float(self.optimizer.param_groups[0]["lr"]),
        }
        self._since_loss, self._since_samples = DeviceSum(), 0.0
        self._log_mark = (now, timer.num_samples)
        if self.runtime.is_rank_zero:
            append_record(self.output_dir, "steps", record)
            self._scalars("step", record, step)

    def close_bar(self) -> None:
        """Close the epoch's progress bar (before the epoch's log line)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def end_epoch(self, record: dict, step: int, *, goodput: float | None = None) -> None:
        """Close the bar; rank 0 appends the epoch ``record`` and its TensorBoard scalars, and
        hands both (and the run's ``goodput`` so far) to the exporters."""
        self.close_bar()
        if self.runtime.is_rank_zero:
            append_record(self.output_dir, "metrics", record)
            self._scalars("epoch", record, step)
            self.exporters.on_epoch(record, step, goodput=goodput)

    def _scalars(self, prefix: str, record: dict, step: int) -> None:
        if self.writer is None:
            return
        for key, value in record.items():
            if key in _NOT_SCALARS or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)):
                group = "step_time" if key.endswith("_s_per_step") else prefix
                self.writer.add_scalar(f"{group}/{key}", value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        """Close the bar and the TensorBoard writer (safe to call twice); the exporters stay
        open for the summary (``Exporters.finish``)."""
        self.close_bar()
        if self.writer is not None:
            self.writer.close()
            self.writer = None
