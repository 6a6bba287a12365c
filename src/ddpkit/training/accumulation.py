"""Gradient accumulation: K micro-steps per optimizer step, gradients synced on the last only.

The loop (forward AND backward inside ``with micro:``)::

    accumulator = GradientAccumulator(model, runtime, num_micro_steps=4)
    for window in accumulator.windows(loader):          # one window = one optimizer step
        optimizer.zero_grad(set_to_none=True)
        for micro in window:
            x, y = (t.to(runtime.device) for t in micro.batch)
            with micro:                                 # DDP no_sync() unless micro.is_last
                loss = F.cross_entropy(model(x), y)     # mean over this micro-batch
                micro.backward(loss)                    # normalised over the global window
        optimizer.step()

Why forward must be inside: DDP decides in *forward* whether the next backward all-reduces
(``no_sync`` only flips a flag that forward reads). A context around backward alone syncs every
micro-step; a forward run outside ``with micro:`` while a window is open raises here instead.

Loss normalisation: the gradient of one optimizer step is the mean over every sample of the
window, all micro-steps and all ranks: ``sum_i grad(loss_i) / N_global``. DDP divides the summed
gradients by ``world_size``, so a micro-batch of ``n`` samples with mean loss ``L`` is
back-propagated as ``L * n * world_size / N_global``. ``N_global`` is exact also for a smaller
last micro-batch: with a :class:`~ddpkit.ShardedLoader` every rank's shard (and so every batch)
has the same size, so ``N_global = world_size * local samples`` with no communication; for any
other iterable one all-reduce of the local count per window finds it.

Trailing partial window: at the end of a pass the last ``len(loader) % K`` micro-batches form a
shorter window that still makes an optimizer step, normalised over its own samples, so every
sample counts. An epoch therefore has ``ceil(len(loader) / K)`` optimizer steps: count LR
schedule steps, checkpoints and ``max_steps`` in optimizer steps (windows), never micro-steps.
A checkpoint taken after a window's optimizer step sits on a window boundary, so resume is exact.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ddpkit.data.sampler import ShardedLoader
from ddpkit.errors import ConfigError, DistributedError
from ddpkit.monitoring.observe import StepTimer
from ddpkit.parallel.fsdp import gradient_sync_off
from ddpkit.runtime.collectives import all_reduce_sum
from ddpkit.runtime.process_group import Runtime
from ddpkit.training.dynamic import UnusedParameterDiagnosis
from ddpkit.training.precision import MixedPrecision
from ddpkit.training.rules import static_graph_with_accumulation


def default_num_samples(batch: Any) -> int:
    """Samples in ``batch``: the first dimension of its first tensor (tuple, list or dict)."""
    first = batch
    while isinstance(first, (tuple, list, dict)):
        first = next(iter(first.values())) if isinstance(first, dict) else first[0]
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        raise ConfigError(
            f"cannot count samples in a batch of type {type(batch).__name__}. Pass "
            "num_samples_fn=lambda batch: ... to GradientAccumulator."
        )
    return int(first.shape[0])


class GradientAccumulator:
    """Group micro-batches into optimizer steps; sync gradients on each window's last only.

    Collective: iterate :meth:`windows` on every rank with the same number of batches. At
    world size 1 (a plain module) nothing syncs and no count is all-reduced; the loss is still
    the mean over the window's samples.

    Args:
        model: the wrapped model (DDP, or a plain module at world size 1 where nothing syncs).
        runtime: the job's :class:`~ddpkit.Runtime`.
        num_micro_steps: K, micro-batches per optimizer step (>= 1; 1 = no accumulation).
        precision: autocast and loss scaling applied inside each micro-step (default fp32).
        same_batch_sizes: every rank's i-th batch has the same size, so the global sample
            count needs no all-reduce. ``None``: true for a :class:`~ddpkit.ShardedLoader`
            whose ranks share one batch size (equal shards), else false (one all-reduce of the
            counts per window).
        num_samples_fn: samples in a batch (default: first dimension of its first tensor).
        timer: a :class:`~ddpkit.StepTimer` that counts the all-reduce of the sample counts as
            ``comm_wait`` (it waits for the slowest rank's loader); ``None``: untimed.

    Raises:
        ConfigError: ``num_micro_steps`` is not a positive integer; or it is above 1 for a DDP
            model built with ``static_graph=True``: torch 2.13's DDP fails with
            "expect_autograd_hooks_ INTERNAL ASSERT FAILED" under ``no_sync`` in that mode
            (pytorch/pytorch#143580; the open fix, #187732, notes that once past the assert
            the gradients silently stop being all-reduced).

    Example:
        >>> accumulator = GradientAccumulator(model, rt, num_micro_steps=4)
        >>> for window in accumulator.windows(loader):
        ...     for micro in window:
        ...         with micro:  # no_sync() but on the window's last micro-step
        ...             x, y = micro.batch
        ...             micro.backward(F.cross_entropy(model(x), y))
        ...     optimizer.step()
        ...     optimizer.zero_grad()
    """

    def __init__(
        self,
        model: nn.Module,
        runtime: Runtime,
        *,
        num_micro_steps: int = 1,
        precision: MixedPrecision | None = None,
        same_batch_sizes: bool | None = None,
        num_samples_fn: Any = default_num_samples,
        timer: StepTimer | None = None,
    ) -> None:
        if isinstance(num_micro_steps, bool) or not isinstance(num_micro_steps, int):
            num_micro_steps = -1
        if num_micro_steps < 1:
            raise ConfigError(
                f"invalid gradient accumulation: num_micro_steps={num_micro_steps}. It must be "
                "an integer >= 1 (micro-batches per optimizer step). Pass e.g. 4."
            )
        static_graph = bool(getattr(model, "static_graph", False))
        problem = static_graph_with_accumulation(static_graph, num_micro_steps)
        if problem:
            raise ConfigError(f"invalid gradient accumulation: {problem}.")
        self.model = model
        self.runtime = runtime
        self.num_micro_steps = num_micro_steps
        self.precision = precision or MixedPrecision("32", runtime)
        self.same_batch_sizes = same_batch_sizes
        self.num_samples_fn = num_samples_fn
        self.timer = timer
        self.diagnosis = UnusedParameterDiagnosis(model, runtime)
        self._open_window: AccumulationWindow | None = None
        self._active: MicroStep | None = None

    @property
    def current_micro_step(self) -> MicroStep | None:
        """The micro-step whose ``with`` block is running now, else ``None``."""
        return self._active

    def num_optimizer_steps(self, num_batches: int) -> int:
        """Optimizer steps for ``num_batches`` micro-batches: ``ceil(num_batches / K)``."""
        return -(-num_batches // self.num_micro_steps)

    def windows(self, batches: Iterable[Any]) -> Iterator[AccumulationWindow]:
        """Yield one :class:`AccumulationWindow` of up to K micro-batches per optimizer step.

        Collective: call on every rank. Each window's micro-batches are drawn before its first
        micro-step (the global sample count must be known before the first backward).

        Raises:
            DistributedError: a window was left before all its micro-steps ran; a forward ran
                outside ``with micro:`` while a window was open.
        """
        same = self.same_batch_sizes
        if isinstance(batches, ShardedLoader):
            batches.sample_weighted = True  # no warning about batch sizes: weighed per sample
            same = batches.same_batch_sizes if same is None else same
        same = bool(same)
        iterator = iter(batches)
        handles = self._register_hooks()
        try:
            for index in itertools.count():
                micro_batches = list(itertools.islice(iterator, self.num_micro_steps))
                if not micro_batches:
                    return
                sizes = [self.num_samples_fn(b) for b in micro_batches]
                num_global = self._global_samples(sum(sizes), same)
                window = AccumulationWindow(self, index, micro_batches, sizes, num_global)
                self._open_window = window
                yield window
                if window.num_done < len(micro_batches):
                    raise DistributedError(
                        f"gradient accumulation: window {index} left after {window.num_done} "
                        f"of {len(micro_batches)} micro-steps. Run every micro-step of a window "
                        "(for micro in window: with micro: ...) before the optimizer step."
                    )
                self._open_window = None
        finally:
            self._open_window = self._active = None
            for handle in handles:
                handle.remove()

    def _global_samples(self, num_local: int, same_batch_sizes: bool) -> int:
        if self.runtime.world_size == 1 or same_batch_sizes:
            return num_local * self.runtime.world_size
        with self.timer.waiting() if self.timer else contextlib.nullcontext():
            return int(all_reduce_sum([num_local], self.runtime)[0])

    def _register_hooks(self) -> list[Any]:
        return [
            self.model.register_forward_pre_hook(self._before_forward),
            *self.diagnosis.attach(),
        ]

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if self._active is not None:
            self._active.num_forwards += 1
        elif self._open_window is not None and torch.is_grad_enabled():
            window = self._open_window
            raise DistributedError(
                f"gradient accumulation: forward ran outside the micro-step context in window "
                f"{window.index} (micro-step {window.num_done} of {len(window.micro_batches)}). "
                "DDP decides in forward whether backward syncs, so such a forward syncs every "
                "micro-step. Put forward and backward inside 'with micro:'."
            )


class AccumulationWindow:
    """The micro-steps of one optimizer step. Iterate it to get each :class:`MicroStep`.

    Attributes:
        index: window number in this pass, from 0.
        micro_batches: the K (or fewer, at the end of a pass) batches of this window.
        num_samples: samples in this window over all ranks (the loss normaliser).
        num_done: micro-steps completed so far.
    """

    def __init__(
        self,
        accumulator: GradientAccumulator,
        index: int,
        micro_batches: list[Any],
        sizes: list[int],
        num_samples: int,
    ) -> None:
        self.accumulator = accumulator
        self.index = index
        self.micro_batches = micro_batches
        self.sizes = sizes
        self.num_samples = num_samples
        self.num_done = 0

    def __len__(self) -> int:
        return len(self.micro_batches)

    def __iter__(self) -> Iterator[MicroStep]:
        last = len(self.micro_batches) - 1
        for i, (batch, size) in enumerate(zip(self.micro_batches, self.sizes, strict=True)):
            yield MicroStep(self, i, batch, size, is_last=i == last)


class MicroStep:
    """One micro-step; a context manager whose body holds its forward and backward.

    Not the last of its window: the body runs under ``model.no_sync()`` (DDP), or with FSDP's
    gradient sync off (``set_requires_gradient_sync(False)``): gradients stay local and
    accumulate. The last: gradients are all-reduced (FSDP: reduce-scattered) during its
    backward. The precision's
    autocast covers the body; :meth:`backward` runs outside autocast.

    Attributes:
        batch: this micro-batch, as the loader yielded it.
        index: position in the window, from 0.
        num_samples: samples in this micro-batch on this rank.
        is_last: the micro-step whose backward syncs gradients.
        loss_scale: factor a *mean* loss is multiplied by: ``n * world_size / N_global``.
    """

    def __init__(
        self, window: AccumulationWindow, index: int, batch: Any, num_samples: int, is_last: bool
    ) -> None:
        self.window = window
        self.index = index
        self.batch = batch
        self.num_samples = num_samples
        self.is_last = is_last
        world_size = window.accumulator.runtime.world_size
        self.loss_scale = num_samples * world_size / max(window.num_samples, 1)
        self.num_forwards = 0
        self.num_backwards = 0
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> MicroStep:
        acc = self.window.accumulator
        if acc._active is not None or self.index != self.window.num_done:
            raise DistributedError(
                f"gradient accumulation: micro-step {self.index} entered out of order (window "
                f"{self.window.index} has completed {self.window.num_done}). Enter each "
                "micro-step once, in order, never nested."
            )
        self._stack = contextlib.ExitStack()
        if not self.is_last:  # DDP's no_sync(), FSDP's set_requires_gradient_sync(False)
            self._stack.enter_context(gradient_sync_off(acc.model))
        self._stack.enter_context(acc.precision.autocast())
        acc._active = self
        return self

    def backward(self, loss: torch.Tensor, reduction: str = "mean") -> None:
        """Back-propagate ``loss`` normalised over the window's global samples.

        Args:
            loss: this micro-batch's loss, a scalar: its ``mean`` over the micro-batch (the
                default of torch's losses) or its ``sum`` (``reduction="sum"``).
            reduction: ``"mean"`` or ``"sum"``: how ``loss`` was reduced.

        Raises:
            DistributedError: called outside ``with micro:`` or twice in one micro-step.
            ConfigError: unknown ``reduction``.
        """
        acc = self.window.accumulator
        if acc._active is not self or self.num_backwards:
            raise DistributedError(
                "gradient accumulation: micro.backward(loss) must be called once, inside "
                "'with micro:', after the forward of that micro-step."
            )
        if reduction not in ("mean", "sum"):
            raise ConfigError(f"unknown reduction={reduction!r}. Allowed: mean, sum.")
        scale = self.loss_scale if reduction == "mean" else self.loss_scale / self.num_samples
        scaled = loss if scale == 1.0 else loss * scale  # 1.0: bitwise the plain loop
        if self.is_last:
            acc.diagnosis.record_loss(loss)
        with torch.autocast(acc.precision.device_type, enabled=False):
            # the last micro-step's backward all-reduces DDP's buckets: watched as a collective
            with (
                acc.runtime.watch("backward (DDP gradient all-reduce)")
                if self.is_last
                else (contextlib.nullcontext())
            ):
                acc.precision.scale_loss(scaled).backward()
        self.num_backwards += 1

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        acc = self.window.accumulator
        acc._active = None
        assert self._stack is not None
        self._stack.close()
        if exc is not None:
            if isinstance(exc, RuntimeError):
                explained = acc.diagnosis.explain(exc)
                if explained is not None:
                    raise explained from exc
            return
        if self.num_forwards < 1 or self.num_backwards != 1:
            raise DistributedError(
                f"gradient accumulation: micro-step {self.index} of window {self.window.index} "
                f"ran {self.num_forwards} forward(s) and {self.num_backwards} backward(s) inside "
                "'with micro:'. Run the model's forward and micro.backward(loss) inside it."
            )
        self.window.num_done += 1
