"""One optimizer step of data-parallel training, spelled out: :class:`TrainStep`.

What one call does, in order (``ddpkit train`` and ``ddpkit bench``'s ddpkit form run exactly
this)::

    optimizer.zero_grad(set_to_none=True)
    for micro in window:                          # K micro-batches (num_micro_steps)
        with micro:                               # DDP no_sync() unless the last; autocast
            loss = loss_fn(model(x), y)           # forward inside: DDP decides sync here
            micro.backward(loss)                  # normalised over the global batch; scaled
    if guard is None or guard.check(step, loss, model=model):   # NaN/Inf, decided by every rank
        precision.step(optimizer, model, max_norm)        # unscale, clip, step, scaler update

Gradients are all-reduced once per optimizer step, during the last micro-step's backward (DDP
overlaps it with backward). The wrap guard that :func:`ddpkit.wrap_model` attaches checks every
forward and backward of the step (parameters changed after wrapping, a backward DDP does not
sync); the unused-parameter diagnosis explains DDP's errors in the same place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ddpkit.errors import ConfigError
from ddpkit.guards.nonfinite import NonFiniteGuard
from ddpkit.live.outcomes import StepDiscarded
from ddpkit.monitoring.observe import StepTimer
from ddpkit.monitoring.stragglers import StragglerDetector
from ddpkit.parallel.live import all_reduce_gradients, stepping
from ddpkit.parallel.strategy import wrapped_strategy
from ddpkit.runtime.process_group import Runtime
from ddpkit.training.accumulation import (
    AccumulationWindow,
    GradientAccumulator,
    default_num_samples,
)
from ddpkit.training.device_values import DeviceValues, values_tensor
from ddpkit.training.precision import MixedPrecision

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """What one optimizer step did, on this rank.

    Attributes:
        step: the optimizer step's number, from 1 (counting on from ``start_step``); taken or
            skipped, every step counts.
        loss_sums: per micro-step, this rank's micro-batch mean loss times its samples
            (float64). From :class:`TrainStep` it is a
            :class:`~ddpkit.training.device_values.DeviceValues`: it stays on the device until
            read (the first read copies all K values to the host, one sync);
            :attr:`loss_sums_tensor` never reads.
        num_samples: this rank's samples in the step (all its micro-batches).
        num_samples_global: every rank's samples in the step (the loss normaliser).
        skipped: the optimizer did not step: the non-finite guard or the 16-mixed loss scaler
            skipped it (the same decision on every rank).
        grad_norm: total L2 norm of the unscaled gradients before clipping, when clipping is on
            and the step was not skipped by the guard; else ``None``.
        phase_s: seconds of this step per phase (``data_wait``, ``forward``,
            ``backward_comm``, ``optimizer``; see :class:`~ddpkit.StepTimer`) when timed, else
            ``None``.
        loss_global: live fault tolerance: the step's mean loss over every member's samples
            (it comes with the members' votes, no extra collective); else ``None``.
    """

    step: int
    loss_sums: Sequence[float]
    num_samples: int
    num_samples_global: int
    skipped: bool
    grad_norm: float | None = None
    phase_s: Mapping[str, float] | None = None
    loss_global: float | None = None

    @property
    def loss_sums_tensor(self) -> torch.Tensor:
        """:attr:`loss_sums` as a float64 tensor of shape ``(num_micro_steps,)`` without a
        device-to-host read: on the step's device (on CPU when the result was built from
        floats). Add it up on the device and read the total once per logging interval."""
        return values_tensor(self.loss_sums)

    @property
    def loss_sum(self) -> float:
        """This rank's summed per-sample loss of the step (float, Python's ``sum``; reads
        :attr:`loss_sums`)."""
        return sum(self.loss_sums)

    @property
    def loss(self) -> float:
        """This rank's mean loss per sample in the step (NaN/Inf when its loss was).

        The step's loss over the whole global batch is the sum over ranks of ``loss_sum``
        divided by ``num_samples_global`` (one all-reduce, e.g. :func:`ddpkit.all_reduce_sum`;
        the step itself adds none).
        """
        return self.loss_sum / max(self.num_samples, 1)


def check_strategy_pairing(
    model: nn.Module, optimizer: torch.optim.Optimizer, precision: MixedPrecision
) -> None:
    """Refuse a sharded strategy stepped in a way that silently undoes it.

    Raises:
        ConfigError: a ``zero1`` model with an optimizer that is not a
            ``ZeroRedundancyOptimizer`` (the state would stay whole on every rank); an ``fsdp``
            model whose optimizer holds parameters that are not its shards (built before
            ``wrap_model``: it would step tensors FSDP no longer uses), or with ``16-mixed``
            (no loss scaler for sharded gradients).
    """
    loss_scaled = precision.scaler is not None
    wrapped_strategy(model).check_optimizer(optimizer, loss_scaled=loss_scaled)


class TrainStep:
    """One optimizer step: zero_grad, K micro-steps, guards, unscale/clip/step.

    Call it with the windows of :meth:`windows` (one window = one optimizer step); or iterate
    :func:`~ddpkit.train_epoch`, which does that for one pass over a loader and yields each
    :class:`StepResult`. The LR schedule, checkpoints and logging stay in the caller's loop.

    Collective: call on every rank, for every window (DDP's gradient all-reduce; the guard's and
    the 16-mixed scaler's small all-reduces). At world size 1 (a plain module) nothing syncs.

    Args:
        model: the wrapped model (:func:`ddpkit.wrap_model`), or a plain module.
        optimizer: the optimizer over ``model``'s parameters.
        runtime: the job's :class:`~ddpkit.Runtime`.
        num_micro_steps: K, micro-batches per optimizer step (gradient accumulation; 1 = none).
        precision: autocast, loss scaling and clipping (default: fp32,
            ``MixedPrecision("32", runtime)``). Its ``scaler`` is what a checkpoint saves.
        loss_fn: ``loss_fn(outputs, targets)``: a micro-batch's *mean* loss (cross-entropy).
        clip_grad_norm: clip the total L2 norm of the unscaled gradients to this (0 = off).
        guard: a :class:`~ddpkit.guards.nonfinite.NonFiniteGuard` deciding, across ranks,
            whether a step with a NaN/Inf loss or gradient is skipped or raises (``None``: no
            check, no all-reduce). Not with ``16-mixed``, whose scaler skips such steps.
        timer: a :class:`~ddpkit.StepTimer` splitting each step's time (``None``: a timer
            that measures host time for the straggler detector and reports nothing).
        start_step: optimizer steps already taken (after a resume); the next step is
            ``start_step + 1``.
        same_batch_sizes: see :class:`~ddpkit.GradientAccumulator`.
        num_samples_fn: see :class:`~ddpkit.GradientAccumulator`.
        stragglers: name a rank whose data loading or compute is persistently slower than the
            others' (:mod:`ddpkit.monitoring.stragglers`): ``True`` (default) builds a
            :class:`~ddpkit.monitoring.stragglers.StragglerDetector` with its defaults; pass one
            to set its rule; ``False``: off. Off whatever is passed at world size 1 and with
            live fault tolerance.

    Each batch is ``(inputs, targets)``, moved to ``runtime.device`` in the step.

    Attributes:
        num_steps: optimizer steps run so far, taken or skipped (``start_step`` included).
        precision: the :class:`~ddpkit.MixedPrecision` the step uses.
        accumulator: the :class:`~ddpkit.GradientAccumulator` that forms the windows.
        timer: the step timer (a disabled one when none was given).
        stragglers: the straggler detector, or ``None``.

    Raises:
        ConfigError: ``num_micro_steps`` is not a positive integer, or above 1 with DDP's
            ``static_graph=True`` (see :class:`~ddpkit.GradientAccumulator`); a strategy and
            optimizer or precision that do not go together (see
            :func:`check_strategy_pairing`).

    Example:
        >>> step = TrainStep(model, optimizer, runtime=rt, num_micro_steps=4)
        >>> for result in ddpkit.train_epoch(step, loader):
        ...     if not result.skipped:
        ...         schedule.step()
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        runtime: Runtime,
        num_micro_steps: int = 1,
        precision: MixedPrecision | None = None,
        loss_fn: LossFn = F.cross_entropy,
        clip_grad_norm: float = 0.0,
        guard: NonFiniteGuard | None = None,
        timer: StepTimer | None = None,
        start_step: int = 0,
        same_batch_sizes: bool | None = None,
        num_samples_fn: Callable[[Any], int] = default_num_samples,
        stragglers: StragglerDetector | bool = True,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.runtime = runtime
        self.precision = precision or MixedPrecision("32", runtime)
        check_strategy_pairing(model, optimizer, self.precision)
        self.timer = timer or StepTimer(runtime, enabled=False)
        self.accumulator = GradientAccumulator(
            model,
            runtime,
            num_micro_steps=num_micro_steps,
            precision=self.precision,
            same_batch_sizes=same_batch_sizes,
            num_samples_fn=num_samples_fn,
            timer=self.timer,
        )
        self.loss_fn = loss_fn
        self.clip_grad_norm = clip_grad_norm
        self.guard = guard
        self.num_steps = start_step
        self.stragglers = _straggler_detector(stragglers, runtime)
        if runtime.step_probe is not None:  # wrap_model's, for a loop without TrainStep
            runtime.step_probe.close()
            runtime.step_probe = None
        if self.stragglers is not None:
            self.timer.watch_gradients(model)  # comm_wait: split off the backward

    @property
    def num_micro_steps(self) -> int:
        """K, micro-batches per optimizer step."""
        return self.accumulator.num_micro_steps

    def num_optimizer_steps(self, num_batches: int) -> int:
        """Optimizer steps for ``num_batches`` micro-batches: ``ceil(num_batches / K)``."""
        return self.accumulator.num_optimizer_steps(num_batches)

    def windows(self, batches: Iterable[Any]) -> Iterator[AccumulationWindow]:
        """One window of up to K micro-batches per optimizer step (see
        :meth:`ddpkit.GradientAccumulator.windows`). Collective: iterate on every rank."""
        return self.accumulator.windows(batches)

    def __call__(self, window: AccumulationWindow) -> StepResult:
        """Run one optimizer step on ``window``'s micro-batches.

        Collective: call on every rank with its window of the same index.

        Live fault tolerance (``runtime.live``): backward runs locally, then the gradients are
        all-reduced and the members vote; the optimizer steps only when every member completed
        the step, else :class:`~ddpkit.live.outcomes.StepDiscarded` is raised on every member
        after they moved to the next quorum (:func:`~ddpkit.train_epoch` trains the step's
        samples again there).

        Raises:
            NonFiniteError: the guard is in ``raise`` mode and a rank's loss or gradients hold
                NaN/Inf (on every rank, naming the ranks and the step).
            DistributedError: the ranks' step counters or 16-mixed loss scales differ.
        """
        if self.runtime.live is not None:
            return self._live_call(window)
        timer = self.timer
        with timer.phase("optimizer"):
            self.optimizer.zero_grad(set_to_none=True)
        window_loss, loss_sums, num_samples = self._micro_steps(window)
        self.num_steps += 1
        with timer.phase("optimizer"):
            stepped, grad_norm = self._update(window_loss)
        phase_s = timer.end_step(window.num_samples)
        if self.stragglers is not None:  # collective every `window` steps
            self.stragglers.observe(
                self.num_steps, timer.last_split, waits=timer.last_wait, num_samples=num_samples
            )
        return StepResult(
            step=self.num_steps,
            loss_sums=loss_sums,
            num_samples=num_samples,
            num_samples_global=window.num_samples,
            skipped=not stepped,
            grad_norm=grad_norm,
            phase_s=phase_s,
        )

    def _micro_steps(self, window: AccumulationWindow) -> tuple[torch.Tensor, DeviceValues, int]:
        """Forward and backward of the window's micro-steps (the last syncs gradients).

        No device-to-host read: the losses stay on the device (float64 products, bitwise the
        host's ``float(loss) * n``).

        Returns:
            ``(summed micro-batch mean losses, per-micro-step loss x samples, local samples)``.
        """
        device, timer = self.runtime.device, self.timer
        window_loss = torch.zeros((), device=device)
        losses: list[torch.Tensor] = []
        sizes: list[int] = []
        for micro in window:
            with timer.phase("data_wait"):
                inputs, targets = (t.to(device) for t in micro.batch)
            with micro:  # no_sync() unless last; forward AND backward inside
                with timer.phase("forward"):
                    loss = self.loss_fn(self.model(inputs), targets)
                with timer.phase("backward_comm"):  # includes DDP's overlapped all-reduce
                    micro.backward(loss)
            window_loss += loss.detach().float()
            losses.append(loss.detach())
            sizes.append(len(targets))
        return window_loss, _loss_sums(losses, sizes), sum(sizes)

    def _update(self, window_loss: torch.Tensor) -> tuple[bool, float | None]:
        """The guard's decision, then unscale/clip/step: ``(stepped, grad_norm)``."""
        if self.guard is not None:
            with self.timer.waiting():  # an all-reduce of the ranks' findings
                ok = self.guard.check(self.num_steps, window_loss, model=self.model)
            if not ok:
                return False, None
        update = self.precision.step(self.optimizer, self.model, max_norm=self.clip_grad_norm)
        return update.stepped, update.grad_norm

    def _live_call(self, window: AccumulationWindow) -> StepResult:
        """:meth:`__call__` in a live fault-tolerant job: local backward, then the gradient
        all-reduce and the guard's check as one guarded operation; the optimizer steps only
        on a commit (see :mod:`ddpkit.parallel.live`)."""
        live, timer = self.runtime.live, self.timer
        assert live is not None
        if live.quorum is None:
            raise ConfigError(
                "live fault tolerance: this replacement has not joined the job yet. Call "
                "CheckpointManager(...).resume() before the first step: it heals the model, "
                "optimizer and loader from a live peer."
            )
        with timer.phase("optimizer"):
            self.optimizer.zero_grad(set_to_none=True)
        with stepping(self.model):
            window_loss, loss_sums, num_samples = self._micro_steps(window)

        def sync() -> bool:  # every collective of the step: all-reduce, then the guard
            all_reduce_gradients(self.model, self.runtime.process_group, self.runtime.world_size)
            guard = self.guard
            return guard is None or guard.check(self.num_steps + 1, window_loss, model=self.model)

        with timer.phase("backward_comm"):
            attempt = live.attempt(
                "training step", sync, loss_sum=sum(loss_sums), num_samples=num_samples
            )
        decision = attempt.decision
        stepped, grad_norm = False, None
        if decision.commit:
            self.num_steps += 1
            live.step = self.num_steps
            if attempt.result:
                with timer.phase("optimizer"):
                    update = self.precision.step(
                        self.optimizer, self.model, max_norm=self.clip_grad_norm
                    )
                stepped, grad_norm = update.stepped, update.grad_norm
        else:
            self.optimizer.zero_grad(set_to_none=True)
        phase_s = timer.end_step(window.num_samples)
        live.settle(decision, op="training step", step=self.num_steps + (not decision.commit))
        if not decision.commit:
            raise StepDiscarded(self.num_steps + 1)
        return StepResult(
            step=self.num_steps,
            loss_sums=loss_sums,
            num_samples=num_samples,
            num_samples_global=window.num_samples,
            skipped=not stepped,
            grad_norm=grad_norm,
            phase_s=phase_s,
            loss_global=decision.loss_sum / max(decision.num_samples, 1),
        )


def _loss_sums(losses: list[torch.Tensor], sizes: list[int]) -> DeviceValues:
    """Each micro-step's mean loss times its samples, float64 on the device: bitwise the host's
    ``float(loss) * n`` (a float64 product of the same two numbers), without a read."""
    means = torch.stack([loss.reshape(()) for loss in losses]).double()
    if len(set(sizes)) == 1:  # one scalar product (the usual case: equal micro-batches)
        return DeviceValues(means * sizes[0])
    products = [mean * n for mean, n in zip(means.unbind(0), sizes, strict=True)]
    return DeviceValues(torch.stack(products))


def _straggler_detector(
    stragglers: StragglerDetector | bool, runtime: Runtime
) -> StragglerDetector | None:
    """``TrainStep``'s detector: the one given, a default one, or ``None`` (off, a single
    process, or live fault tolerance, whose quorum may change between two exchanges)."""
    if not stragglers or runtime.world_size == 1 or runtime.live is not None:
        return None
    return stragglers if isinstance(stragglers, StragglerDetector) else StragglerDetector(runtime)
