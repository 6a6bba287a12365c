"""The wrapping settings of ``ddpkit train`` (its ``[wrap]`` section), declared once, without
torch: the strategy, DDP's gradient communication, local SGD, ``torch.compile``.

A settings section (:mod:`ddpkit.settings`): each field carries its flag, default, help and check;
``ddpkit train`` composes it into its ``TrainConfig``, and the rules between two of these fields
are the library's own (:mod:`ddpkit.parallel.rules`, :func:`~ddpkit.parallel.choices.
strategy_problems`). The defaults the strategy objects share (PowerSGD's) come from
:mod:`ddpkit.parallel.choices`.

Example:
    >>> from ddpkit.parallel.config import WrapConfig
    >>> from ddpkit.settings import field_problems
    >>> field_problems(WrapConfig(strategy="ddp", grad_compression="powersgd"))
    []
    >>> field_problems(WrapConfig(strategy="ddpp"))
    ["strategy='ddpp' must be one of 'auto', 'single', 'ddp', ..."]
"""

from __future__ import annotations

from dataclasses import dataclass

from ddpkit.parallel.choices import (
    DEFAULT_CHECK_STEPS,
    FSDP_RESHARD_AFTER_FORWARD,
    GRAD_COMPRESSIONS,
    POWERSGD_RANK,
    POWERSGD_START_STEP,
    STRATEGIES,
)
from ddpkit.settings import at_least, finite, option

__all__ = ["COMPILE_BACKENDS", "WrapConfig"]

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


@dataclass(frozen=True)
class WrapConfig:
    """strategy and gradient communication"""

    strategy: str = option(
        "auto",
        "auto: ddp for 2+ processes, single for one; dp: DataParallel over 2+ GPUs in "
        "one process (--nproc 1; an error without 2 GPUs; PyTorch recommends ddp instead); "
        "zero1: ddp with the optimizer state sharded (ZeroRedundancyOptimizer); fsdp: "
        "parameters, gradients and optimizer state sharded (FSDP2 fully_shard on each layer), "
        "checkpoints saved by every rank (torch.distributed.checkpoint)",
        choices=STRATEGIES,
    )
    reshard_after_forward: bool = option(
        FSDP_RESHARD_AFTER_FORWARD,
        "fsdp: free each layer's gathered parameters after its forward and gather them "
        "again in backward (on, default: ZeRO-3) or keep them until backward (off: ZeRO-2, "
        "more memory, fewer all-gathers)",
        on_off=True,
    )
    bucket_cap_mb: float | None = option(
        None,
        "DDP gradient bucket size in MiB; buckets all-reduce while backward runs "
        "(default: torch's 25 MiB, first bucket 1 MiB)",
        check=finite(above=0),
        metavar="MIB",
    )
    grad_as_bucket_view: bool = option(
        False,
        "make gradients views into DDP's buckets: one copy less per step and no "
        "separate gradient memory (same results)",
    )
    grad_compression: str = option(
        "none",
        "how gradients are all-reduced: none (float32), fp16/bf16 (cast: half the "
        "bytes), powersgd (low-rank factors, see --powersgd-*). Bytes per step are reported "
        "as comm_bytes_per_step (default %(default)s)",
        choices=GRAD_COMPRESSIONS,
    )
    powersgd_rank: int = option(
        POWERSGD_RANK,
        "rank of PowerSGD's factors P and Q (default %(default)s)",
        check=at_least(1),
        metavar="R",
    )
    powersgd_start_step: int = option(
        POWERSGD_START_STEP,
        "optimizer steps with plain all-reduce before PowerSGD compresses "
        "(>= 2; default %(default)s)",
        check=at_least(2),
        metavar="STEPS",
    )
    sync_every: int = option(
        1,
        "1: all-reduce gradients every step (default). H >= 2: local SGD, each rank "
        "steps on its own gradients and parameters are averaged every H steps and at each "
        "epoch end (about H times fewer bytes). --check-replicas-every and "
        "--checkpoint-every must then be multiples of H (replicas agree only after averaging)",
        check=at_least(1),
        resume=True,
        metavar="H",
    )
    sync_batchnorm: bool = option(
        False,
        "convert BatchNorm layers to synchronised ones (statistics over all ranks' "
        "samples); the MNIST CNN has no BatchNorm, so here it only logs that",
    )
    compile: bool = option(
        False,
        "torch.compile the wrapped model (after DDP, in place: checkpoints keep their "
        "keys and resume either way). The first step compiles (seconds to a minute on CPU, "
        "where inductor did not beat eager for this CNN; see docs/performance.md); gradients "
        f"are compared across ranks before the first {DEFAULT_CHECK_STEPS} optimizer steps",
    )
    compile_backend: str = option(
        "inductor",
        "torch.compile backend with --compile: inductor (default; generates "
        "kernels), aot_eager (traces forward and backward, runs them eagerly: fast to compile), "
        "eager (tracing only)",
        choices=COMPILE_BACKENDS,
        metavar="NAME",
    )
