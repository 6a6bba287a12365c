"""Gradient communication: torch's DDP comm hooks for compression, wrapped to count bytes.

``register_grad_hook(ddp_model, runtime, grad_compression="fp16", comm_stats=CommStats())``
registers one DDP communication hook (torch allows exactly one per model, before the first
backward):

- ``none``: torch's ``allreduce_hook`` (the same average DDP computes without a hook);
- ``fp16``: torch's ``fp16_compress_wrapper`` around it (half the bytes);
- ``bf16``: torch's ``bf16_compress_wrapper`` on nccl. torch refuses that hook unless CUDA and
  NCCL 2.10+ are present (a check on the hook's *name*), although gloo all-reduces bfloat16
  correctly; on gloo ddpkit registers :func:`_cast_wrapper`, the same cast-allreduce-cast;
- ``powersgd``: torch's ``powerSGD_hook`` with ``PowerSGDState`` (low-rank, error feedback).
  On gloo it needs all gradients in one DDP bucket (:func:`powersgd_bucket_cap_mb`): the hook
  issues its P and Q all-reduces from future callbacks, which gloo runs on its worker threads,
  so with several buckets the ranks can issue them in different orders ("Received data size
  doesn't match expected size ... collective mismatch", seen with the MNIST CNN's two buckets).
  On nccl the buckets are left as configured (not checked here: no GPU).
  The hook's callbacks also hold the process group; destroying the group right after the
  last backward can leave a gloo thread to free it, which aborts ("Resource deadlock
  avoided"). Any blocking collective in between (evaluation, a barrier) avoids that.

Every hook is wrapped so that :class:`CommStats` counts the payload bytes this rank hands to
all-reduce: the bucket's bytes for plain and cast hooks (after the cast), and for PowerSGD the
elements its own statistics add per bucket (``PowerSGDState.total_numel_after_compression``,
which holds P, Q and the tensors it sends uncompressed) times the element size. A ring
all-reduce moves ``2 (n - 1) / n`` times the payload over the wire; DDP's buffer broadcast
(models with buffers) is not a gradient hook and is not counted.

The hooks carry no type annotations on purpose: DDP checks the annotations, and the string
annotations of ``from __future__ import annotations`` would fail that check.
"""

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from ddpkit.errors import ConfigError
from ddpkit.log import get_logger
from ddpkit.parallel.choices import (  # torch-free: the train flags read them
    GRAD_COMPRESSIONS,
    POWERSGD_RANK,
    POWERSGD_START_STEP,
)
from ddpkit.runtime.process_group import Runtime


@dataclass(kw_only=True)
class CommStats:
    """Bytes this rank handed to all-reduce, counted by ddpkit's wrapping hooks.

    The counts are equal on every rank (all ranks all-reduce the same buckets).

    Attributes:
        grad_bytes: gradient payload bytes all-reduced so far (DDP buckets, after compression).
        averaging_bytes: parameter bytes all-reduced by local SGD's model averaging.
        num_grad_syncs: backward passes whose gradients went through the hook.
        num_averages: model averaging rounds (local SGD).
        num_buckets: buckets in the most recent backward pass.
        builtin_sync_bytes: for a model left on DDP's built-in (C++) all-reduce, with no hook to
            count through: the gradient bytes one sync moves (DDP all-reduces every bucket in
            full at each sync); :meth:`count_builtin_sync` adds them once per synced backward.
    """

    grad_bytes: int = 0
    averaging_bytes: int = 0
    num_grad_syncs: int = 0
    num_averages: int = 0
    num_buckets: int = 0
    builtin_sync_bytes: int = 0
    _buckets_so_far: int = field(default=0, repr=False)

    @property
    def total_bytes(self) -> int:
        """Gradient plus model-averaging payload bytes."""
        return self.grad_bytes + self.averaging_bytes

    def bytes_per_step(self, num_steps: int) -> float:
        """Mean payload bytes per optimizer step over ``num_steps`` steps (0.0 for 0 steps)."""
        return self.total_bytes / num_steps if num_steps else 0.0

    def count_builtin_sync(self) -> None:
        """Count one synced backward of a hook-less DDP model (no-op when
        ``builtin_sync_bytes`` is 0, i.e. when a hook counts instead)."""
        if self.builtin_sync_bytes:
            self.grad_bytes += self.builtin_sync_bytes
            self.num_grad_syncs += 1

    def add_bucket(self, bucket: dist.GradBucket, num_bytes: int) -> None:
        """Count one bucket's payload; a pass ends with the bucket DDP reduces last."""
        self.grad_bytes += int(num_bytes)
        self._buckets_so_far += 1
        if bucket.is_last():
            self.num_grad_syncs += 1
            self.num_buckets, self._buckets_so_far = self._buckets_so_far, 0


@dataclass
class HookState:
    """What ddpkit's wrapping hooks need: the group, the counter and the inner hook's state."""

    process_group: Any
    stats: CommStats
    inner: Any = None


def _buffer_bytes(bucket: dist.GradBucket) -> int:
    buffer = bucket.buffer()
    return buffer.numel() * buffer.element_size()


def _counting_allreduce_hook(state, bucket):
    """torch's ``allreduce_hook`` on the bucket as it is now (cast or not), counted."""
    state.stats.add_bucket(bucket, _buffer_bytes(bucket))
    return default_hooks.allreduce_hook(state.process_group, bucket)


def _cast_wrapper(dtype: torch.dtype, hook):
    """Cast the bucket to ``dtype``, run ``hook``, cast the result back in place.

    The same steps as torch's ``fp16_compress_wrapper``/``bf16_compress_wrapper``; used for
    bfloat16 on gloo, where torch refuses its own wrapper by name.
    """

    def cast_compress_hook(state, bucket):
        bucket.set_buffer(bucket.buffer().to(dtype))
        future = hook(state, bucket)

        def decompress(fut):
            restored = bucket.buffer()
            restored.copy_(fut.value())
            return restored

        return future.then(decompress)

    return cast_compress_hook


def _counting_powersgd_hook(
    state: HookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """torch's ``powerSGD_hook``, counting the elements it sends for this bucket."""
    inner: powerSGD_hook.PowerSGDState = state.inner
    if inner.iter < inner.start_powerSGD_iter:  # still a plain all-reduce of the whole bucket
        state.stats.add_bucket(bucket, _buffer_bytes(bucket))
        return powerSGD_hook.powerSGD_hook(inner, bucket)
    numel_before = inner.total_numel_after_compression  # P, Q and uncompressed tensors
    future = powerSGD_hook.powerSGD_hook(inner, bucket)
    numel = inner.total_numel_after_compression - numel_before
    state.stats.add_bucket(bucket, numel * bucket.buffer().element_size())
    return future


def powersgd_bucket_cap_mb(
    model: nn.Module, runtime: Runtime, ddp_kwargs: dict[str, Any]
) -> dict[str, Any]:
    """``ddp_kwargs`` with a ``bucket_cap_mb`` that puts every gradient in one bucket (gloo).

    Unchanged on nccl. Without ``bucket_cap_mb`` it sets one just above the gradients' size.

    Raises:
        ConfigError: an explicit ``bucket_cap_mb`` too small for one bucket on gloo.
    """
    if runtime.backend == "nccl":
        return ddp_kwargs
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    grad_mib = grad_bytes / 2**20
    given = ddp_kwargs.get("bucket_cap_mb")
    if given is None:
        cap_mb = math.ceil(grad_mib) + 1
        get_logger("parallel").info(
            "PowerSGD on gloo: bucket_cap_mb=%d, so all gradients share one DDP bucket", cap_mb
        )
        return {**ddp_kwargs, "bucket_cap_mb": cap_mb}
    if given <= grad_mib:
        raise ConfigError(
            f"grad_compression='powersgd' on gloo needs every gradient in one DDP bucket: "
            f"bucket_cap_mb={given} but the gradients take {grad_mib:.2f} MiB. torch's PowerSGD "
            "all-reduces from gloo's callback threads, so with several buckets the ranks can "
            "issue them in different orders. Drop bucket_cap_mb (ddpkit then picks one bucket)."
        )
    return ddp_kwargs


def check_compression(compression: str, powersgd_rank: int, powersgd_start_step: int) -> None:
    """Raise :class:`ConfigError` for an unknown compression or bad PowerSGD settings."""
    problems = []
    if compression not in GRAD_COMPRESSIONS:
        problems.append(
            f"grad_compression={compression!r} is not one of {', '.join(GRAD_COMPRESSIONS)}"
        )
    if not isinstance(powersgd_rank, int) or powersgd_rank < 1:
        problems.append(f"powersgd_rank={powersgd_rank!r} must be an integer >= 1")
    if not isinstance(powersgd_start_step, int) or powersgd_start_step < 2:
        problems.append(
            f"powersgd_start_step={powersgd_start_step!r} must be an integer >= 2 (PowerSGD's "
            "error feedback and warm start need at least one uncompressed step first)"
        )
    if problems:
        raise ConfigError(f"invalid gradient compression: {'; '.join(problems)}.")


def register_grad_hook(
    model: DistributedDataParallel,
    runtime: Runtime,
    *,
    grad_compression: str = "none",
    comm_stats: CommStats | None = None,
    powersgd_rank: int = POWERSGD_RANK,
    powersgd_start_step: int = POWERSGD_START_STEP,
) -> CommStats:
    """Register the DDP comm hook for ``grad_compression`` on ``model``, counting bytes in
    ``comm_stats`` (the names :func:`~ddpkit.wrap_model` uses).

    Not a collective itself; call it on every rank before the first backward (the hooks then
    all-reduce during every backward). torch allows one hook per model.

    Args:
        model: a ``DistributedDataParallel`` model without a comm hook.
        runtime: the job's runtime; hooks use its training process group.
        grad_compression: ``none``, ``fp16``, ``bf16`` or ``powersgd``.
        comm_stats: the counter to fill (a new one when omitted).
        powersgd_rank: PowerSGD's ``matrix_approximation_rank`` (rank of P and Q).
        powersgd_start_step: PowerSGD's ``start_powerSGD_iter``: backward passes with a plain
            all-reduce before compression starts (>= 2).

    Returns:
        The :class:`CommStats` being filled.

    Raises:
        ConfigError: unknown compression; PowerSGD settings out of range.
        TypeError: ``bf16`` on nccl older than 2.10 (torch's own check).

    Example:
        >>> ddp_model = wrap_model(Net(), rt)              # no hook yet: DDP's own all-reduce
        >>> stats = register_grad_hook(ddp_model, rt, grad_compression="fp16")
        >>> ddp_model(torch.randn(8, 4)).sum().backward()  # one backward: the buckets go out
        >>> stats.bytes_per_step(1) > 0
        True
    """
    compression = grad_compression
    check_compression(compression, powersgd_rank, powersgd_start_step)
    stats = comm_stats if comm_stats is not None else CommStats()
    state = HookState(runtime.process_group, stats)
    hook = _counting_allreduce_hook
    if compression == "fp16":
        hook = default_hooks.fp16_compress_wrapper(_counting_allreduce_hook)
    elif compression == "bf16" and runtime.backend == "nccl":
        hook = default_hooks.bf16_compress_wrapper(_counting_allreduce_hook)
    elif compression == "bf16":
        hook = _cast_wrapper(torch.bfloat16, _counting_allreduce_hook)
    elif compression == "powersgd":
        state.inner = powerSGD_hook.PowerSGDState(
            process_group=runtime.process_group,
            matrix_approximation_rank=powersgd_rank,
            start_powerSGD_iter=powersgd_start_step,
        )
        hook = _counting_powersgd_hook
    model.register_comm_hook(state, hook)
    return stats
