"""The loop of one epoch as a generator: one :class:`~ddpkit.StepResult` per optimizer step.

The caller's loop body is the training script, in plain sight (as nanoGPT's ``train.py``
reads)::

    step = ddpkit.TrainStep(model, optimizer, runtime=rt, num_micro_steps=4)
    for epoch in range(num_epochs):
        epoch_loss = EpochLoss()
        for result in ddpkit.train_epoch(step, loader):
            if not result.skipped:
                schedule.step()               # LR schedules count optimizer steps
            epoch_loss.add(result)
            ckpt.maybe_save(result.step, ...)  # between steps: on a window boundary
        train_loss, num_samples = epoch_loss.reduce(rt)

Nothing of the next step runs while the caller's body runs (the next window's batches are drawn
only when the loop asks for it), so a checkpoint taken there holds the loader's exact position.
"""

from __future__ import annotations

import itertools
from collections.abc import Generator, Iterable, Iterator, Sized
from typing import Any

from ddpkit.data.sampler import ShardedLoader
from ddpkit.errors import ConfigError
from ddpkit.live.outcomes import StepDiscarded
from ddpkit.runtime.collectives import all_reduce_sum
from ddpkit.runtime.process_group import Runtime
from ddpkit.training.device_values import DeviceSum
from ddpkit.training.step import StepResult, TrainStep
from ddpkit.training.uneven import join_uneven_inputs, verify_even_batches


def train_epoch(
    step: TrainStep,
    batches: Iterable[Any],
    *,
    max_steps: int | None = None,
    join: bool = False,
) -> Iterator[StepResult]:
    """Run ``step`` over one pass of ``batches``, yielding each optimizer step's result.

    The pass is grouped into windows of K = ``step.num_micro_steps`` batches (the last may be
    shorter), so it yields ``ceil(num_batches / K)`` results, each after its optimizer step and
    before the next window is drawn. With a :class:`~ddpkit.ShardedLoader`, each ``iter`` is the
    next epoch (after a resume: the rest of the interrupted one).

    Collective: iterate on every rank to the same end (DDP's backward; without ``join``, one
    all-reduce up front comparing the ranks' batch counts, so uneven inputs fail at once
    instead of hanging). At world size 1 nothing is communicated.

    Args:
        step: the :class:`~ddpkit.TrainStep` to run (its ``timer`` also times the data wait).
        batches: a :class:`~ddpkit.ShardedLoader` or any iterable of ``(inputs, targets)``.
        max_steps: stop after this many optimizer steps (``None``: the whole pass). The loader's
            pass then ends early; its next ``iter`` starts the next epoch.
        join: run the pass inside torch's ``Join`` (:func:`~ddpkit.join_uneven_inputs`), for
            ranks with different numbers of batches.

    Yields:
        One :class:`~ddpkit.StepResult` per optimizer step, numbered on from ``step.num_steps``.

    Raises:
        ValueError: ``max_steps`` below 1.
        UnevenInputsError: without ``join``, the ranks have different numbers of batches.

    Example:
        >>> step = TrainStep(model, optimizer, runtime=rt)
        >>> for result in train_epoch(step, loader, max_steps=2):
        ...     print(result.step, result.num_samples, f"loss {result.loss:.3f}")
        1 4 loss ...
        2 4 loss ...
    """
    if max_steps is not None and max_steps < 1:
        raise ValueError(
            f"invalid max_steps={max_steps}. It must be >= 1 (optimizer steps), or None for "
            "the whole pass."
        )
    return _results(step, batches, max_steps, join)


def _results(
    step: TrainStep, batches: Iterable[Any], max_steps: int | None, join: bool
) -> Iterator[StepResult]:
    """The generator of :func:`train_epoch` (its arguments already checked)."""
    step.model.train()
    if step.runtime.live is not None:
        yield from _live_results(step, batches, max_steps)
        return
    if not join:
        _verify_even(step, batches, max_steps)
    timer = step.timer
    with join_uneven_inputs(step.model, step.runtime, enable=join):  # stragglers paused
        windows = step.windows(batches)
        assert isinstance(windows, Generator)  # GradientAccumulator.windows: a generator
        try:
            for _ in range(max_steps) if max_steps is not None else itertools.count():
                with timer.phase("data_wait"):  # the window draws its K batches up front
                    window = next(windows, None)
                if window is None:
                    return
                yield step(window)
        finally:
            windows.close()  # stopped early: release the accumulator's hooks now


def _live_results(
    step: TrainStep, loader: Iterable[Any], max_steps: int | None
) -> Iterator[StepResult]:
    """:func:`train_epoch` in a live fault-tolerant job: when the quorum changes (a member
    died, left or joined), the pass goes on from the loader's last committed position,
    re-sharded over the new members; a discarded step's samples are trained again."""
    live = step.runtime.live
    assert live is not None
    if not isinstance(loader, ShardedLoader):
        raise ConfigError(
            "live fault tolerance: train_epoch needs the loader of ddpkit.build_train_loader, "
            f"got {type(loader).__name__}: after a member is lost the rest of the epoch is "
            "re-sharded from its global position, which only that loader keeps."
        )
    done = 0
    while True:
        committed = loader.state_dict()  # between steps: where the next step's samples start
        pass_epoch, quorum = committed["epoch"], live.quorum
        windows = step.windows(loader)
        assert isinstance(windows, Generator)  # GradientAccumulator.windows: a generator
        try:
            while True:
                if committed["epoch"] == pass_epoch:  # not past the pass's last step: a
                    live.admit()  # replacement taken in here starts where the members are
                if live.quorum is not quorum:
                    break
                window = next(windows, None)
                if window is None:
                    return  # the pass is over
                try:
                    result = step(window)
                except StepDiscarded:
                    break
                yield result
                done += 1
                if max_steps is not None and done >= max_steps:
                    return
                committed = loader.state_dict()
                if live.quorum is not quorum:
                    break
        finally:
            windows.close()
        if committed["epoch"] != pass_epoch:
            return  # the pass ended (a change after its last step belongs to the next one)
        loader.load_state_dict(committed)  # go on from there, dealt to the new members


def _verify_even(step: TrainStep, batches: Iterable[Any], max_steps: int | None) -> None:
    """Compare the ranks' batch counts of this pass (one all-reduce); skip unknown lengths."""
    if isinstance(batches, ShardedLoader):
        if batches.full_pass_batches() is None:  # a stream: even by design
            return
        num_batches = batches.next_pass_size()[0]
        assert num_batches is not None  # a pass of known length (checked above)
    elif isinstance(batches, Sized):
        num_batches = len(batches)
    else:
        return
    if max_steps is not None:
        num_batches = min(num_batches, max_steps * step.num_micro_steps)
    verify_even_batches(num_batches, step.runtime)


class EpochLoss:
    """This rank's running train-loss sums of one epoch; the mean over all ranks at the end.

    The loss sum stays on the device (:class:`~ddpkit.training.device_values.DeviceSum`, no
    sync per step); reading :attr:`loss_sum` or :meth:`reduce` reads it once.

    Attributes:
        num_samples: this rank's samples so far.

    Example:
        >>> step = TrainStep(model, optimizer, runtime=rt)
        >>> epoch_loss = EpochLoss()
        >>> for result in train_epoch(step, loader):
        ...     epoch_loss.add(result)
        >>> train_loss, num_samples = epoch_loss.reduce(runtime)
        >>> num_samples  # every rank's: 2 ranks x 4 batches x 4
        32.0
    """

    def __init__(self) -> None:
        self._loss_sum = DeviceSum()
        self.num_samples = 0.0

    @property
    def loss_sum(self) -> float:
        """This rank's summed per-sample loss so far (one device-to-host read)."""
        return self._loss_sum.value()

    def add(self, result: StepResult) -> None:
        """Add one step's losses and samples (micro-step by micro-step; no host read)."""
        self._loss_sum.add_each(result.loss_sums_tensor)
        self.num_samples += result.num_samples

    def reduce(self, runtime: Runtime) -> tuple[float, float]:
        """``(mean loss over every rank's samples, samples of every rank)``.

        Collective: call on every rank (one all-reduce of two floats; none at world size 1).
        """
        loss_sum, num_samples = all_reduce_sum([self.loss_sum, self.num_samples], runtime).tolist()
        return loss_sum / max(num_samples, 1.0), num_samples
