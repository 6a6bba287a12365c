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
    ``zero_grad``, the non-finite guard (when on), unscale/clip and ``optimizer.step``
    (through the GradScaler when on).

What the caller's loop does between steps (the LR schedule, checkpoints, replica checks,
logging) is in no phase.

Inside ``backward_comm``, the part spent waiting for the other ranks (``comm_wait``) is told
apart when :meth:`StepTimer.watch_gradients` hooked the model's parameters: the wait runs from
the moment this rank's last gradient was accumulated (its own backward is done; DDP's last
bucket is launched) to the end of backward (DDP's all-reduce finished). The straggler detector
(:mod:`ddpkit.monitoring.stragglers`) reads it from each step's split.

Cost: on CPU a ``time.perf_counter`` pair per phase (well under a microsecond) and one Python
hook call per parameter per backward (about a microsecond each). On CUDA the kernels are
asynchronous, so an enabled timer calls ``torch.cuda.synchronize`` at every phase boundary
(four per micro-step): the GPU queue drains and the host no longer runs ahead, typically a few
percent of the step time for small models. With ``enabled=False`` (``--step-timing off``) the
timer still measures host time (no synchronisation; on CUDA that is the time the host spent,
which names a slow data loader but not slow kernels) for the straggler detector, and reports
nothing: :meth:`StepTimer.end_step` returns ``None`` and the epoch summary has no phases.

Example:
    >>> timer = StepTimer(runtime)
    >>> step = ddpkit.TrainStep(model, optimizer, runtime=runtime, timer=timer)
    >>> for result in ddpkit.train_epoch(step, loader):
    ...     forward_s = result.phase_s["forward"]                   # this step's split
    >>> sorted(result.phase_s)
    ['backward_comm', 'data_wait', 'forward', 'optimizer']
    >>> summary = timer.epoch_summary(runtime)                     # collective, once an epoch
    >>> summary["forward_s_per_step"] > 0
    True
"""

from __future__ import annotations

import contextlib
import resource
import sys
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from ddpkit.runtime.collectives import gather_per_rank
from ddpkit.runtime.process_group import Runtime

PHASES = ("data_wait", "forward", "backward_comm", "optimizer")
COMM_WAIT = "comm_wait"  # the part of backward_comm spent waiting on other ranks (not a phase)


def _ignore(*_args: Any) -> None:
    """What a copied module's timing hook does: nothing."""


def _ignoring() -> Any:
    return _ignore


class WeakHook:
    """A module or tensor hook that calls ``owner``'s method through a weak reference.

    The hooks live in the model's hook dicts, so a copy of the model (``copy.deepcopy``, e.g.
    torch's ``AveragedModel`` for an EMA; ``pickle``) copies them: this one becomes a hook that
    does nothing instead of dragging the timer (and the process group it reaches) along.
    """

    def __init__(self, method: Any) -> None:
        self._method = weakref.WeakMethod(method)

    def __call__(self, *args: Any) -> None:
        method = self._method()
        if method is not None:
            method(*args)

    def __deepcopy__(self, memo: dict) -> Any:
        return _ignore

    def __reduce__(self) -> tuple:
        return (_ignoring, ())


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

    :class:`~ddpkit.TrainStep` calls :meth:`phase` around each part of a step and
    :meth:`end_step` after each optimizer step; :meth:`epoch_summary` reduces the epoch over
    ranks and starts the next.

    Args:
        runtime: the job's :class:`~ddpkit.Runtime` (its device decides whether to synchronize).
        enabled: report the split (and on CUDA synchronize at phase boundaries); ``False``
            measures host time only, for :attr:`last_split`, and reports nothing.

    Attributes:
        seconds: this rank's seconds per phase in the current epoch, summed over steps.
        num_steps: optimizer steps ended in the current epoch.
        num_samples: samples of those steps over all ranks (from the accumulation windows).
        last_split: this rank's seconds per phase of the last ended step, plus ``comm_wait``
            (0.0 unless :meth:`watch_gradients` hooked the model or :meth:`waiting` timed a
            collective); measured also when disabled.
        last_wait: of :attr:`last_split`'s ``comm_wait``, the part inside each phase.
    """

    def __init__(self, runtime: Runtime, enabled: bool = True) -> None:
        self.runtime = runtime
        self.enabled = enabled
        self._sync = enabled and runtime.device.type == "cuda"
        self._grad_ready_at = 0.0  # perf_counter of the last gradient accumulated
        self._open: str | None = None  # the phase being timed now
        self._hooks: list[Any] = []
        self.last_split: dict[str, float] = {**dict.fromkeys(PHASES, 0.0), COMM_WAIT: 0.0}
        self.last_wait: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.reset()

    def watch_gradients(self, model: torch.nn.Module) -> None:
        """Hook ``model``'s parameters so that ``backward_comm`` splits off ``comm_wait``.

        A ``register_post_accumulate_grad_hook`` (torch >= 2.1) on every parameter that
        requires a gradient records when it was accumulated; sharded (FSDP) parameters are left
        out, their gradients arrive through FSDP's reduce-scatter. Call once per model; a no-op
        on torch without the hook.
        """
        if self._hooks:
            return
        for param in model.parameters():
            if not param.requires_grad or not hasattr(param, "register_post_accumulate_grad_hook"):
                continue
            if type(param) is not torch.nn.Parameter and type(param.data) is not torch.Tensor:
                continue  # a DTensor: FSDP's reduce-scatter delivers it
            hook = WeakHook(self._grad_ready)
            self._hooks.append(param.register_post_accumulate_grad_hook(hook))

    def _grad_ready(self, _param: torch.Tensor) -> None:
        self._grad_ready_at = time.perf_counter()

    def unwatch(self) -> None:
        """Remove the hooks of :meth:`watch_gradients` (safe to call twice)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def reset(self) -> None:
        """Zero the per-epoch sums and counts."""
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.num_steps = 0
        self.num_samples = 0
        self._step_seconds = {**dict.fromkeys(PHASES, 0.0), COMM_WAIT: 0.0}
        self._step_wait = dict.fromkeys(PHASES, 0.0)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Count the ``with`` body (a small collective inside a phase, e.g. the all-reduce of a
        window's sample count) as ``comm_wait`` of the phase being timed; host time, no
        synchronisation. Outside a phase it counts nowhere."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._open is not None:
                elapsed = time.perf_counter() - start
                self._step_seconds[COMM_WAIT] += elapsed
                self._step_wait[self._open] += elapsed

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the wall time of the ``with`` body to phase ``name`` (CUDA: synchronized).

        Raises:
            KeyError: ``name`` is not one of :data:`PHASES`.
        """
        if name not in self.seconds:
            raise KeyError(f"unknown step phase: name={name!r}. Allowed: {', '.join(PHASES)}.")
        self._synchronize()
        start, outer, self._open = time.perf_counter(), self._open, name
        try:
            yield
        finally:
            self._synchronize()
            end, self._open = time.perf_counter(), outer
            self.seconds[name] += end - start
            self._step_seconds[name] += end - start
            if name == "backward_comm" and start < self._grad_ready_at <= end:
                self._step_seconds[COMM_WAIT] += end - self._grad_ready_at
                self._step_wait[name] += end - self._grad_ready_at

    def _synchronize(self) -> None:
        if self._sync:
            torch.cuda.synchronize(self.runtime.device)

    def end_step(self, num_samples_global: int) -> dict[str, float] | None:
        """Count one optimizer step of ``num_samples_global`` samples (all ranks).

        Returns:
            This rank's seconds per phase since the previous ``end_step`` (the step's split;
            ``comm_wait`` is in :attr:`last_split`), or ``None`` when the timer is disabled.
        """
        self.num_steps += 1
        self.num_samples += num_samples_global
        self.last_split, self.last_wait = self._step_seconds, self._step_wait
        self._step_seconds = {**dict.fromkeys(PHASES, 0.0), COMM_WAIT: 0.0}
        self._step_wait = dict.fromkeys(PHASES, 0.0)
        return {name: self.last_split[name] for name in PHASES} if self.enabled else None

    def epoch_summary(self, runtime: Runtime | None = None) -> dict[str, float]:
        """The epoch's phase times (mean over ranks) and peak memory (max over ranks); resets.

        Collective: call on every rank (one all-reduce of ``world_size * 6`` floats through
        :func:`~ddpkit.runtime.collectives.gather_per_rank`). At world size 1 no
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
