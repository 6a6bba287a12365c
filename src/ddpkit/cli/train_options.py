"""``ddpkit train``'s option groups beyond the basics: strategy and gradient communication
(issue 3, items 4-7), the training step (accumulation, precision, dynamic models, Join), and
watching a run (progress bar, step timing, metrics files, TensorBoard; issue 7).

Each group has its ``add_*_arguments(parser, defaults)`` and its ``*_problems(args)``, which
returns one string per invalid value so that ``config_from_args`` can report them all at once.
"""

from __future__ import annotations

import argparse
import math

from ddpkit.app.mnist.config import TrainConfig
from ddpkit.app.mnist.monitor import PROGRESS_MODES, TENSORBOARD_MODES
from ddpkit.errors import ConfigError
from ddpkit.parallel.comm import GRAD_COMPRESSIONS
from ddpkit.parallel.wrap import STRATEGIES
from ddpkit.training.precision import PRECISIONS


def add_wrap_arguments(parser: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    """Strategy, gradient communication, local SGD and sync batch norm (wrap-time options)."""
    group = parser.add_argument_group("strategy and gradient communication")
    group.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default=defaults.strategy,
        help="auto: ddp for 2+ processes, single for one; dp: DataParallel over 2+ GPUs in "
        "one process (--nproc 1; an error without 2 GPUs; PyTorch recommends ddp instead)",
    )
    group.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=defaults.bucket_cap_mb,
        metavar="MIB",
        help="DDP gradient bucket size in MiB; buckets all-reduce while backward runs "
        "(default: torch's 25 MiB, first bucket 1 MiB)",
    )
    group.add_argument(
        "--grad-as-bucket-view",
        action="store_true",
        help="make gradients views into DDP's buckets: one copy less per step and no "
        "separate gradient memory (same results)",
    )
    group.add_argument(
        "--grad-compression",
        choices=GRAD_COMPRESSIONS,
        default=defaults.grad_compression,
        help="how gradients are all-reduced: none (float32), fp16/bf16 (cast: half the "
        "bytes), powersgd (low-rank factors, see --powersgd-*). Bytes per step are reported "
        "as comm_bytes_per_step (default none)",
    )
    group.add_argument(
        "--powersgd-rank",
        type=int,
        default=defaults.powersgd_rank,
        metavar="R",
        help=f"rank of PowerSGD's factors P and Q (default {defaults.powersgd_rank})",
    )
    group.add_argument(
        "--powersgd-start-step",
        type=int,
        default=defaults.powersgd_start_step,
        metavar="STEPS",
        help="optimizer steps with plain all-reduce before PowerSGD compresses "
        f"(>= 2; default {defaults.powersgd_start_step})",
    )
    group.add_argument(
        "--sync-every",
        type=int,
        default=defaults.sync_every,
        metavar="H",
        help="1: all-reduce gradients every step (default). H >= 2: local SGD, each rank "
        "steps on its own gradients and parameters are averaged every H steps and at each "
        "epoch end (about H times fewer bytes). --check-replicas-every and "
        "--checkpoint-every must then be multiples of H (replicas agree only after averaging)",
    )
    group.add_argument(
        "--sync-batchnorm",
        action="store_true",
        help="convert BatchNorm layers to synchronised ones (statistics over all ranks' "
        "samples); the MNIST CNN has no BatchNorm, so here it only logs that",
    )


def wrap_problems(args: argparse.Namespace) -> list[str]:
    """Problems of the wrap-time flags that need no knowledge of the process count."""
    problems = []
    if args.bucket_cap_mb is not None and not (
        math.isfinite(args.bucket_cap_mb) and args.bucket_cap_mb > 0
    ):
        problems.append(f"--bucket-cap-mb {args.bucket_cap_mb} must be a finite number > 0")
    if args.powersgd_rank < 1:
        problems.append(f"--powersgd-rank {args.powersgd_rank} must be >= 1")
    if args.powersgd_start_step < 2:
        problems.append(f"--powersgd-start-step {args.powersgd_start_step} must be >= 2")
    if args.sync_every < 1:
        problems.append(f"--sync-every {args.sync_every} must be >= 1")
    elif args.sync_every > 1:
        if args.grad_compression != "none":
            problems.append(
                f"--sync-every {args.sync_every} with --grad-compression "
                f"{args.grad_compression}: local SGD sends no gradients to compress; pick one"
            )
        if args.static_graph:
            problems.append(
                f"--sync-every {args.sync_every} with --static-graph: DDP fails in static-graph "
                "mode with gradient sync off, and the static graph only speeds up the sync "
                "local SGD skips; drop --static-graph"
            )
        if args.join:
            problems.append(
                f"--sync-every {args.sync_every} with --join: Join cannot stand in for a "
                "finished rank in local SGD's parameter averaging; pick one"
            )
        for name in ("check_replicas_every", "checkpoint_every"):
            value = getattr(args, name)
            if value % args.sync_every:
                problems.append(
                    f"--{name.replace('_', '-')} {value} must be a multiple of --sync-every "
                    f"{args.sync_every} (replicas agree only right after averaging)"
                )
    return problems


def check_strategy(config: TrainConfig, nproc: int) -> None:
    """Refuse a strategy that does not fit the number of processes, before any worker starts.

    Raises:
        ConfigError: ``single``/``dp`` with several processes; ``ddp`` with one; DDP options
            (bucket, compression, local SGD, sync batch norm) without DDP; ``dp`` without 2+
            CUDA devices.
    """
    strategy = config.strategy
    if strategy == "auto":
        strategy = "ddp" if nproc > 1 else "single"
    if config.strategy in ("single", "dp") and nproc > 1:
        raise ConfigError(
            f"--strategy {config.strategy} runs in one process: --nproc {nproc}. Use --nproc 1, "
            "or --strategy ddp for several processes."
        )
    if strategy == "ddp" and nproc < 2:
        raise ConfigError("--strategy ddp needs --nproc 2 or more. Use --strategy single.")
    ddp_only = {
        "--bucket-cap-mb": config.bucket_cap_mb is not None,
        "--grad-as-bucket-view": config.grad_as_bucket_view,
        "--grad-compression": config.grad_compression != "none",
        "--sync-every": config.sync_every > 1,
        "--sync-batchnorm": config.sync_batchnorm,
    }
    given = [flag for flag, on in ddp_only.items() if on]
    if strategy != "ddp" and given:
        raise ConfigError(
            f"{', '.join(given)} configure DDP's gradient sync, and strategy={strategy} "
            f"(--nproc {nproc}) has none. Use --nproc 2 or more (ddp), or drop them."
        )
    if strategy == "dp":
        from ddpkit.parallel.dp import check_dp_possible

        check_dp_possible(1)


def add_step_arguments(parser: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    """Flags of the training step: accumulation, precision, clipping, dynamic models, Join."""
    group = parser.add_argument_group("training step")
    group.add_argument(
        "--grad-accum",
        type=int,
        default=defaults.grad_accum,
        metavar="K",
        help="micro-batches per optimizer step (default 1): the first K-1 run forward and "
        "backward without gradient sync; global batch = B x world size x K. --max-steps, "
        "--checkpoint-every and the LR schedule count optimizer steps",
    )
    group.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=defaults.precision,
        help="32 (default), bf16-mixed (autocast to bfloat16, CPU and CUDA) or 16-mixed "
        "(float16 autocast with a loss scaler; every rank skips an overflowed step together)",
    )
    group.add_argument(
        "--clip-grad-norm",
        type=float,
        default=defaults.clip_grad_norm,
        metavar="X",
        help="clip the total L2 norm of the unscaled gradients to X before each optimizer "
        "step (default 0 = off)",
    )
    group.add_argument(
        "--find-unused-parameters",
        action="store_true",
        help="DDP option for models whose forward skips some parameters on some steps "
        "(costs a graph traversal per step)",
    )
    group.add_argument(
        "--static-graph",
        action="store_true",
        help="DDP option for models whose set of used parameters is the same every step",
    )
    group.add_argument(
        "--join",
        action="store_true",
        help="train each epoch inside torch's Join, for ranks with different numbers of "
        "batches (the train loader is even, so this only adds Join's bookkeeping: two small "
        "all-reduces per forward)",
    )


def step_problems(args: argparse.Namespace) -> list[str]:
    problems = []
    if args.grad_accum < 1:
        problems.append(f"--grad-accum {args.grad_accum} must be >= 1")
    if not (math.isfinite(args.clip_grad_norm) and args.clip_grad_norm >= 0):
        problems.append(f"--clip-grad-norm {args.clip_grad_norm} must be a finite number >= 0")
    if args.static_graph and args.grad_accum > 1:
        problems.append(
            f"--static-graph cannot be combined with --grad-accum {args.grad_accum}: torch's "
            "DDP breaks no_sync in static-graph mode (pytorch/pytorch#143580)"
        )
    if args.precision == "16-mixed" and args.on_nonfinite != "off":
        problems.append(
            f"--precision 16-mixed needs --on-nonfinite off (got {args.on_nonfinite}): the "
            "loss scaler already skips overflowed steps on every rank"
        )
    return problems


def add_observe_arguments(parser: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    """Flags of watching a run: progress bar, step timing, step records, TensorBoard."""
    group = parser.add_argument_group("watching a run")
    group.add_argument(
        "--progress",
        choices=PROGRESS_MODES,
        default=defaults.progress,
        help="rank 0's progress bar per epoch on stderr, with global samples/s and ETA: auto "
        "(default; only when stderr is a terminal), on, off",
    )
    group.add_argument(
        "--log-every",
        type=int,
        default=defaults.log_every,
        metavar="N",
        help="every N optimizer steps append a record to steps.jsonl and steps.csv: mean "
        "train loss over all ranks since the last record, global samples/s, learning rate "
        f"(default {defaults.log_every}; 0 = none)",
    )
    group.add_argument(
        "--step-timing",
        type=on_off,
        metavar="{on,off}",
        default=defaults.step_timing,
        help="split each step's time into data wait, forward, backward (with DDP's overlapped "
        "all-reduce) and optimizer, in seconds per step in metrics.jsonl/csv (default on; "
        "free on CPU, on CUDA it synchronizes the GPU at each phase boundary)",
    )
    group.add_argument(
        "--tensorboard",
        choices=TENSORBOARD_MODES,
        default=defaults.tensorboard,
        help="auto (default): TensorBoard event files in OUTPUT_DIR/tensorboard when the "
        "tensorboard package is installed (pip install 'ddpkit[tensorboard]'); off",
    )


def on_off(text: str) -> bool:
    """``on`` -> True, ``off`` -> False (an argparse ``type``)."""
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from 'on', 'off')")
    return text == "on"


def observe_problems(args: argparse.Namespace) -> list[str]:
    """Problems of the observability flags."""
    if args.log_every < 0:
        return [f"--log-every {args.log_every} must be >= 0 (0 = no step records)"]
    return []
