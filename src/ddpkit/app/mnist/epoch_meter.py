"""The figures of one epoch of ``ddpkit train`` (train loss, samples, seconds), kept across a
restart.

An epoch interrupted (``kill -9``, a lost node) and resumed from a checkpoint inside it used to
be recorded from the steps after the resume only: a lower train loss, fewer samples, a shorter
time. :class:`EpochMeter` is part of the checkpointed state instead, so the resumed epoch's
record covers every step of the epoch, and says that it was resumed.

How the sums stay exact and replicated: each rank adds its own steps' losses and samples locally
(no collective per step); at every step a checkpoint is taken (periodic or at an agreed stop),
:meth:`EpochMeter.sync` folds every rank's figures since the last sync into totals that are the
same on every rank (one all-reduce of three float64 values), so rank 0's copy in the checkpoint
is everyone's. An uninterrupted run syncs at the same checkpoint steps, so a resumed epoch adds
the same partial sums in the same order: its train loss and samples are bitwise those of the
uninterrupted run (an epoch stopped by a signal folds once more, at its stop step, so its loss
may differ from the uninterrupted run's in the last bits). Its seconds are the training seconds
of the steps that count (each attempt's time up to the checkpoint it resumed from, then the
resumed part), the mean over the ranks: the time lost to the restart and to steps that were
redone is not in them."""

from __future__ import annotations

import time
from typing import Any

from ddpkit.runtime.collectives import all_reduce_sum
from ddpkit.runtime.process_group import Runtime
from ddpkit.training.loop import EpochLoss
from ddpkit.training.step import StepResult


class EpochMeter:
    """Train loss, samples and training seconds of the current epoch, resumable mid-epoch.

    Put it in the :class:`~ddpkit.CheckpointManager`'s state: every save calls
    :meth:`before_checkpoint` (a :meth:`sync`) first, so a resume restores the figures of the
    epoch's steps up to the checkpoint.

    Attributes:
        epoch: the epoch (1-based) the figures belong to; 0 before the first.
        totals: ``[loss sum, samples, seconds]`` of every rank through ``synced_step`` (seconds:
            the mean over ranks); the same on every rank.
        synced_step: the optimizer step the totals run to.
        from_step: the steps done before the first step the figures cover (the epoch's start,
            or a resume from a checkpoint saved without :meth:`sync`).
        resumed_at_step: the step this epoch was last resumed at (``None``: one go).
        whole_epoch: the figures cover every step of the epoch (``False`` only when it was
            resumed from a checkpoint saved without :meth:`sync`).

    Example:
        >>> meter = EpochMeter()
        >>> ckpt = CheckpointManager("ckpt", rt, state={"meter": meter}, every_steps=2)
        >>> meter.start(1, ckpt.resume())  # epoch 1, from the checkpoint's step (0: none)
        >>> for result in train_epoch(train_step, loader):
        ...     meter.add(result)
        ...     folder = ckpt.maybe_save(result.step)  # a save syncs the meter first
        >>> meter.finish(rt, result.step)["num_samples"]  # 2 ranks x 4 batches x 4
        32.0
    """

    def __init__(self) -> None:
        self.epoch = 0
        self.totals = [0.0, 0.0, 0.0]
        self.synced_step = self.from_step = 0
        self.resumed_at_step: int | None = None
        self.whole_epoch = True
        self._local = EpochLoss()
        self._mark = time.perf_counter()

    def start(self, epoch: int, step: int) -> None:
        """Before the first step this process runs of ``epoch``; ``step``: the steps done so far.

        When the meter was loaded from a checkpoint inside ``epoch``, its totals go on (and
        ``resumed_at_step`` is ``step``); otherwise they start from zero.
        """
        if self.epoch == epoch:  # restored from a checkpoint taken inside this epoch
            self.resumed_at_step = step
            if self.synced_step != step:  # saved without sync(): those steps' sums are lost
                self.totals, self.from_step, self.whole_epoch = [0.0, 0.0, 0.0], step, False
        else:
            self.epoch, self.totals, self.from_step = epoch, [0.0, 0.0, 0.0], step
            self.resumed_at_step, self.whole_epoch = None, True
        self.synced_step = step
        self._local, self._mark = EpochLoss(), time.perf_counter()

    def add(self, result: StepResult) -> None:
        """Add one optimizer step's losses and samples (this rank's; no collective)."""
        self._local.add(result)

    def sync(self, runtime: Runtime, step: int) -> None:
        """Fold every rank's figures since the last sync into ``totals`` (through ``step``).

        Collective: call on every rank at the same step (one all-reduce of three float64
        values; none at world size 1).
        """
        now = time.perf_counter()
        local = [self._local.loss_sum, self._local.num_samples, now - self._mark]
        loss_sum, num_samples, seconds = all_reduce_sum(local, runtime).tolist()
        added = (loss_sum, num_samples, seconds / runtime.world_size)
        self.totals = [total + value for total, value in zip(self.totals, added, strict=True)]
        self.synced_step = step
        self._local, self._mark = EpochLoss(), now

    def before_checkpoint(self, runtime: Runtime, step: int) -> None:
        """:meth:`sync` at the start of every :meth:`CheckpointManager.save
        <ddpkit.CheckpointManager.save>` (periodic, or at a stop step agreed after a signal), so
        the checkpoint holds every rank's sums through ``step``. Collective, as :meth:`sync`."""
        self.sync(runtime, step)

    def finish(self, runtime: Runtime, step: int) -> dict[str, Any]:
        """The epoch's figures once its last step (``step``) ran.

        Collective: call on every rank (one all-reduce, as :meth:`sync`).

        Returns:
            ``train_loss`` (mean over every rank's samples), ``num_samples`` (global),
            ``epoch_s`` (training seconds, mean over ranks), ``from_step``,
            ``resumed_at_step`` and ``whole_epoch`` (see the class attributes).
        """
        self.sync(runtime, step)
        loss_sum, num_samples, seconds = self.totals
        return {
            "train_loss": loss_sum / max(num_samples, 1.0),
            "num_samples": num_samples,
            "epoch_s": seconds,
            "from_step": self.from_step,
            "resumed_at_step": self.resumed_at_step,
            "whole_epoch": self.whole_epoch,
        }

    def state_dict(self) -> dict[str, Any]:
        """The totals through ``synced_step`` (the same on every rank), not the unsynced rest."""
        return {
            "epoch": self.epoch,
            "totals": list(self.totals),
            "synced_step": self.synced_step,
            "from_step": self.from_step,
            "resumed_at_step": self.resumed_at_step,
            "whole_epoch": self.whole_epoch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; :meth:`start` then goes on from it."""
        self.epoch = int(state["epoch"])
        self.totals = [float(value) for value in state["totals"]]
        self.synced_step = int(state["synced_step"])
        self.from_step = int(state["from_step"])
        self.resumed_at_step = state["resumed_at_step"]
        self.whole_epoch = bool(state["whole_epoch"])


def coverage_note(figures: dict[str, Any], step: int) -> str:
    """What an epoch's log line adds after a resume; ``""`` for an epoch run in one go.

    Example:
        >>> coverage_note({"from_step": 0, "resumed_at_step": 8, "whole_epoch": True}, 12)
        ' (whole epoch, resumed at step 8)'
    """
    resumed = figures["resumed_at_step"]
    if resumed is None:
        return ""
    if figures["whole_epoch"]:
        return f" (whole epoch, resumed at step {resumed})"
    return (
        f" (steps {figures['from_step'] + 1}-{step} only: resumed at step {resumed} from a "
        "checkpoint without this epoch's sums)"
    )
