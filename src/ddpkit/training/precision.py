"""Mixed precision: autocast, loss scaling whose decisions every rank shares, clipping unscaled.

Precisions (the ``--precision`` values, Lightning's names):

- ``32``: plain float32; no autocast, no scaler.
- ``bf16-mixed``: ``torch.autocast`` to bfloat16 (CPU and CUDA). bfloat16 has float32's range,
  so no loss scaling is needed.
- ``16-mixed``: ``torch.autocast`` to float16 with ``torch.amp.GradScaler`` (CUDA, and CPU,
  which torch 2.13 supports for both). The scaler multiplies the loss by its scale before
  backward; a step whose gradients hold inf/NaN is skipped and the scale halved.

Cross-rank agreement: DDP averages the gradients before the scaler looks at them, so every rank
normally reaches the same skip decision on its own. ddpkit does not rely on it: in ``16-mixed``
each optimizer step starts with one tiny all-reduce of ``(overflow flag, scale)`` per rank. If
any rank overflowed, every rank skips (a rank whose own gradients were finite marks one of them
inf, so torch's scaler itself makes the skip and halves the scale, as on the rank that
overflowed). If the ranks' scales differ (e.g. one rank loaded another scaler state), every
rank raises naming each rank's scale, before anything is stepped.

Clipping (``max_norm``) runs once, after ``GradScaler.unscale_``, so it always acts on the true
(unscaled) gradients, and the norm :meth:`MixedPrecision.step` reports is the unscaled one.
Under FSDP the gradients are ``DTensor`` shards: torch's ``clip_grad_norm_`` computes the total
norm over every rank's shards (one all-reduce) and scales each shard by the same factor.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from ddpkit.errors import ConfigError, DistributedError
from ddpkit.parallel.fsdp import full_value
from ddpkit.runtime.collectives import gather_per_rank
from ddpkit.runtime.process_group import Runtime
from ddpkit.training.choices import PRECISIONS  # torch-free: the train flags read them


@dataclass(frozen=True)
class OptimizerUpdate:
    """What :meth:`MixedPrecision.step` did to the optimizer (a :class:`~ddpkit.TrainStep`
    reports it in its :class:`~ddpkit.StepResult`).

    Attributes:
        stepped: the optimizer stepped (false when the scaler skipped an overflowed step; the
            same on every rank).
        grad_norm: the total L2 norm of the *unscaled* gradients before clipping, or ``None``
            when clipping is off.
    """

    stepped: bool
    grad_norm: float | None


class MixedPrecision:
    """Autocast, loss scaling and clipping for one training job.

    Args:
        precision: ``"32"``, ``"bf16-mixed"`` or ``"16-mixed"``.
        runtime: the job's :class:`~ddpkit.Runtime` (its device picks autocast's device type).
        init_scale: the GradScaler's first loss scale (``16-mixed`` only).
        growth_interval: steps without overflow before the scale doubles (``16-mixed`` only).

    Attributes:
        scaler: the ``torch.amp.GradScaler`` (``16-mixed``), else ``None``; pass it to
            :class:`~ddpkit.CheckpointManager` (``state={"scaler": mp.scaler, ...}``) so resume
            restores its scale.

    Raises:
        ConfigError: unknown precision; ``bf16-mixed`` on a GPU without bfloat16 support.

    Example:
        >>> mp = MixedPrecision("bf16-mixed", rt)
        >>> with mp.autocast():
        ...     loss = F.cross_entropy(model(x), y)
        >>> mp.scale_loss(loss).backward()
        >>> result = mp.step(optimizer, model, max_norm=1.0)
        >>> result.stepped
        True
    """

    def __init__(
        self,
        precision: str,
        runtime: Runtime,
        *,
        init_scale: float = 65536.0,
        growth_interval: int = 2000,
    ) -> None:
        if precision not in PRECISIONS:
            raise ConfigError(
                f"unknown precision: precision={precision!r}. Allowed: {', '.join(PRECISIONS)}. "
                "Use bf16-mixed on CPUs and recent GPUs, 16-mixed on older GPUs."
            )
        self.precision = precision
        self.runtime = runtime
        self.device_type = runtime.device.type
        if (
            precision == "bf16-mixed"
            and self.device_type == "cuda"
            and not torch.cuda.is_bf16_supported()
        ):
            raise ConfigError(
                f"precision=bf16-mixed: {torch.cuda.get_device_name(runtime.device)} has no "
                "bfloat16 support. Use 16-mixed (float16 with loss scaling)."
            )
        self.dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
        self.scaler = (
            torch.amp.GradScaler(
                self.device_type, init_scale=init_scale, growth_interval=growth_interval
            )
            if precision == "16-mixed"
            else None
        )

    def autocast(self) -> contextlib.AbstractContextManager:
        """The autocast context for forward and loss (a no-op context for ``32``)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current loss scale (``16-mixed``), else ``loss`` itself."""
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def step(
        self, optimizer: torch.optim.Optimizer, model: nn.Module, *, max_norm: float = 0.0
    ) -> OptimizerUpdate:
        """Unscale, clip and step (or skip, on every rank alike); returns an OptimizerUpdate.

        Call after the backward of the window's last micro-step, instead of
        ``optimizer.step()``.

        Collective in ``16-mixed``: call on every rank at every optimizer step (one all-reduce
        of ``world_size + 1`` numbers; a local no-op at world size 1). Not a collective for
        ``32`` and ``bf16-mixed``.

        Args:
            optimizer: the optimizer to step.
            model: whose parameters' gradients are clipped.
            max_norm: clip the total L2 norm of the unscaled gradients to this (0 = off).

        Raises:
            DistributedError: ``16-mixed`` and the ranks' loss scales differ.
        """
        overflow = False
        if self.scaler is not None:
            overflow = self._agree_on_overflow(optimizer, self.scaler)
            self.scaler.unscale_(optimizer)  # records inf/NaN; the step below then skips
        grad_norm = None
        if max_norm > 0:
            # FSDP: a DTensor total norm over every rank's shards (torch's DTensor-aware norm)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            grad_norm = float(full_value(norm))
        if self.scaler is None:
            optimizer.step()
            return OptimizerUpdate(True, grad_norm)
        self.scaler.step(optimizer)
        self.scaler.update()
        return OptimizerUpdate(not overflow, grad_norm)

    def _agree_on_overflow(
        self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler
    ) -> bool:
        """True when any rank's scaled gradients hold inf/NaN; then every rank's scaler sees it."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        sums = [g.detach().sum(dtype=torch.float64) for g in grads]  # inf/NaN survive a sum
        local_overflow = bool(sums) and not math.isfinite(float(torch.stack(sums).sum()))
        table = gather_per_rank([local_overflow, scaler.get_scale()], self.runtime)
        scales = table[:, 1].tolist()
        if len(set(scales)) > 1:
            listing = ", ".join(f"rank {r} {s:g}" for r, s in enumerate(scales))
            raise DistributedError(
                f"loss scale differs across ranks: {listing}. Every rank must start from the "
                "same GradScaler state (same init_scale, or the same checkpoint); a rank-"
                "dependent scale would step some ranks and skip others."
            )
        overflow = bool(table[:, 0].any())
        if overflow and not local_overflow and grads:
            with torch.no_grad():  # let torch's own scaler skip and back off, as on the others
                grads[0].view(-1)[0] = math.inf
        return overflow
