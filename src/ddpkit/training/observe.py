"""Step timing and peak memory of a training epoch, reduced across ranks once per epoch.

A step (one optimizer step, i.e. one accumulation window) is split into four phases:

``data_wait``
    waiting for the window's batches from the loader (the loader's ``__iter__``/``__next__``,
    so a slow ``Dataset.__getitem__`` with ``num_workers=0`` lands here) plus the copy of
    each micro-batch to the device.
``forward``
    the model's forward and the loss, summed over the window's micro-steps.
``backward_comm``
    backward, summed over the micro-steps; it *includes* DDP's gradient all-reduce, which DDP
    overlaps with backward (its bucket hooks fire while autograd runs), so the two cannot be
    told apart from outside. A large value at world size N against a small one at world size
    1 is communication.
``optimizer``
    ``zero_grad``, the non-finite guard (when on), unscale/clip, ``optimizer.step`` (through
    the GradScaler when on) and the LR schedule step.

What ``on_step`` callbacks do (checkpoints, replica checks) is in no phase.

Cost: on CPU a ``time.perf_counter`` pair per phase (well under a microsecond). On CUDA the
kernels are asynchronous, so the timer calls ``torch.cuda.synchronize`` at every phase boundary
(four per micro-step): the GPU queue drains and the host no longer runs ahead, typically a few
percent of the step time for small models. Pass ``enabled=False`` (``--step-timing off``) to
avoid it; the loop then measures nothing.

Example:
    >>> timer = StepTimer(runtime)                                   # doctest: +SKIP
    >>> train_one_epoch(model, loader, opt, sched, runtime, timer=timer)
    >>> timer.epoch_summary(runtime)["forward_s_per_step"]
"""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from collections.abc import Iterator

import torch

from ddpkit.distributed.collectives import gather_per_rank
from ddpkit.distributed.process_group import Runtime

PHASES = ("data_wait", "forward", "backward_comm", "optimizer")


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process in MiB (2**20 bytes).

    On CUDA: ``torch.cuda.max_memory_allocated(device)`` (tensors this process allocated on
    that device, since the start or the last ``torch.cuda.reset_peak_memory_stats``). Elsewhere:
    the peak resident set size of this process since it started (``ru_maxrss``, KiB on Linux,
    bytes on macOS).
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


class StepTimer:
    """Seconds per step phase (``data_wait``, ``forward``, ``backward_comm``, ``optimizer``).

    The training loop calls :meth:`phase` around each part of a step and :meth:`end_step` after
    each optimizer step; :meth:`epoch_summary` reduces the epoch over ranks and starts the next.

    Args:
        runtime: the job's :class:`~ddpkit.Runtime` (its device decides whether to synchronize).
        enabled: measure; ``False`` turns :meth:`phase` into a no-op (no CUDA synchronisation).

    Attributes:
        seconds: this rank's seconds per phase in the current epoch, summed over steps.
        num_steps: optimizer steps ended in the current epoch.
        num_samples: samples of those steps over all ranks (from the accumulation windows).
        last_loss_sum: this rank's summed per-sample loss of the step just ended.
        last_num_samples: this rank's samples of the step just ended.
    """

    def __init__(self, runtime: Runtime, enabled: bool = True) -> None:
        self.runtime = runtime
        self.enabled = enabled
        self._sync = enabled and runtime.device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        """Zero the per-epoch sums and counts."""
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.num_steps = 0
        self.num_samples = 0
        self.last_loss_sum = 0.0
        self.last_num_samples = 0

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the wall time of the ``with`` body to phase ``name`` (CUDA: synchronized).

        Raises:
            KeyError: ``name`` is not one of :data:`PHASES`.
        """
        if not self.enabled:
            yield
            return
        if name not in self.seconds:
            raise KeyError(f"unknown step phase: name={name!r}. Allowed: {', '.join(PHASES)}.")
        self._synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._synchronize()
            self.seconds[name] += time.perf_counter() - start

    def _synchronize(self) -> None:
        if self._sync:
            torch.cuda.synchronize(self.runtime.device)

    def end_step(self, num_samples_global: int, *, loss_sum: float, num_samples: int) -> None:
        """Count one optimizer step: its global samples, this rank's loss sum and samples."""
        self.num_steps += 1
        self.num_samples += num_samples_global
        self.last_loss_sum = loss_sum
        self.last_num_samples = num_samples

    def epoch_summary(self, runtime: Runtime | None = None) -> dict[str, float]:
        """The epoch's phase times (mean over ranks) and peak memory (max over ranks); resets.

        Collective: call on every rank (one all-reduce of ``world_size * 6`` floats through
        :func:`~ddpkit.distributed.collectives.gather_per_rank`). At world size 1 no
        communication.

        Returns:
            ``{"<phase>_s": seconds summed over the epoch's steps, "<phase>_s_per_step": that
            over the steps, "step_s_per_step": the four phases' sum per step,
            "peak_memory_mb": the largest rank's peak in MiB}``, phases averaged over ranks.
            Without timing (``enabled=False``) only ``peak_memory_mb``.
        """
        runtime = runtime or self.runtime
        local = [self.seconds[p] for p in PHASES]
        local += [float(self.num_steps), peak_memory_mb(runtime.device)]
        table = gather_per_rank(local, runtime)  # (world_size, 6)
        mean, peak = table.mean(dim=0).tolist(), float(table[:, -1].max())
        num_steps = max(mean[len(PHASES)], 1.0)
        summary: dict[str, float] = {}
        if self.enabled:
            for index, name in enumerate(PHASES):
                summary[f"{name}_s"] = mean[index]
                summary[f"{name}_s_per_step"] = mean[index] / num_steps
            summary["step_s_per_step"] = sum(mean[: len(PHASES)]) / num_steps
        summary["peak_memory_mb"] = peak
        self.reset()
        return summary
