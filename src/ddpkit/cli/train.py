"""``ddpkit train``: the MNIST CNN with DDP on N local processes (the main job).

The command validates everything and resolves the data *before* any worker starts, then either
launches N ranks through ``ddpkit run`` (which re-enter this command as workers), or — when it is
already inside a launched job (``torchrun -m ddpkit train``) — trains in this process.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
from dataclasses import fields
from pathlib import Path

import torch

from ddpkit.app.mnist.config import TrainConfig, resume_settings
from ddpkit.app.mnist.data import DATASETS, RANK_MEMORY_MIB, DataSource, resolve_data
from ddpkit.app.mnist.job import train_mnist
from ddpkit.app.mnist.model import OPTIMIZERS
from ddpkit.app.mnist.resume import interrupted_note
from ddpkit.checkpoint.io import read_manifest
from ddpkit.checkpoint.manager import check_compatible, newest_manifest
from ddpkit.cli.train_options import (
    add_observe_arguments,
    add_step_arguments,
    add_wrap_arguments,
    check_strategy,
    observe_problems,
    step_problems,
    wrap_problems,
)
from ddpkit.distributed.env import detect_process_info
from ddpkit.distributed.process_group import BACKENDS
from ddpkit.errors import ConfigError
from ddpkit.files import make_output_folder, unwritable_ancestor
from ddpkit.launch.launcher import LaunchSpec, launch

WORKER_FLAG = "--_worker"


def default_nproc() -> int:
    """One process per GPU on CUDA, else 2."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    defaults = TrainConfig()
    parser = subparsers.add_parser(
        "train",
        help="train the MNIST CNN with DDP on N local processes",
        description="Train a small CNN on MNIST (1x28x28 inputs, 10 classes) with "
        "DistributedDataParallel. Prints per-epoch train loss, test loss, test accuracy and "
        "samples/s; writes metrics.jsonl/csv, steps.jsonl/csv, summary.json, model.pt and "
        "(with tensorboard installed) tensorboard/ to --output-dir.",
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        metavar="N",
        help="local processes (default: one per GPU on CUDA, else 2)",
    )
    parser.add_argument(  # None: the data set's own default (DEFAULT_EPOCHS)
        "--epochs", type=int, default=None, help="passes over the data (default 1; digits: 20)"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=defaults.batch_size,
        metavar="B",
        help=f"samples per rank per step (default {defaults.batch_size}); "
        "global batch = B x world size",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=defaults.lr,
        help=f"peak learning rate of the one-cycle schedule (default {defaults.lr})",
    )
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default=defaults.optimizer)
    parser.add_argument(
        "--seed",
        type=int,
        default=defaults.seed,
        help="seed of model init and data order (same on every rank)",
    )
    parser.add_argument(
        "--dataset",
        choices=DATASETS,
        default="auto",
        help="auto: MNIST (data dir, cache or download), else the 8x8 digits",
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        metavar="DIR",
        help="folder holding the four MNIST IDX files (raw or .gz)",
    )
    parser.add_argument(
        "--no-download",
        action="store_true",
        help="never download MNIST; use the cache or --data-dir",
    )
    parser.add_argument(
        "--output-dir",
        default=defaults.output_dir,
        metavar="DIR",
        help=f"where outputs go (default {defaults.output_dir})",
    )
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="auto: nccl when each local rank has a GPU, else gloo",
    )
    parser.add_argument(
        "--init-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="how long ranks wait for each other to join (default 300)",
    )
    parser.add_argument(
        "--train-timeout",
        type=float,
        default=1800.0,
        metavar="SECONDS",
        help="how long one collective may wait (default 1800)",
    )
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="watchdog: a rank waiting in a collective longer than this while another rank "
        "runs other code ends the job with a report naming the busy rank and its Python stack; "
        "ranks stuck in collectives that cannot match end it after 5 s (default 300; 0 = "
        "watchdog off)",
    )
    parser.add_argument(
        "--max-steps",
        type=int,
        default=0,
        metavar="S",
        help="stop each epoch after S steps (0 = whole epoch); for quick checks",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        metavar="STEPS",
        help="save a checkpoint to OUTPUT_DIR/checkpoints every STEPS optimizer steps "
        "(0 = never; keeps the last 3)",
    )
    parser.add_argument(
        "--resume",
        default="",
        metavar="auto|PATH",
        help="resume from the newest complete checkpoint in OUTPUT_DIR (auto) or from PATH",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="R",
        help="restart all ranks up to R times after a failure; with --checkpoint-every they "
        "resume from the newest complete checkpoint (default 0)",
    )
    parser.add_argument(
        "--on-nonfinite",
        choices=("raise", "skip", "off"),
        default="off",
        help="NaN/Inf loss or gradient on any rank: every rank raises naming the rank and step, "
        "every rank skips that step, or no check (default; the check adds one small all-reduce, "
        "a synchronisation point, per step: about 7%% of the MNIST step time on 2 CPU cores)",
    )
    parser.add_argument(
        "--check-replicas-every",
        type=int,
        default=0,
        metavar="N",
        help="compare parameter checksums across ranks every N steps (0 = never)",
    )
    add_wrap_arguments(parser, defaults)
    add_step_arguments(parser, defaults)
    add_observe_arguments(parser, defaults)
    parser.add_argument(WORKER_FLAG, action="store_true", help=argparse.SUPPRESS)
    parser.set_defaults(handler=run)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Build and validate the config; one :class:`ConfigError` lists every problem."""
    problems = []
    for name in ("epochs", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:  # None: from the data
            problems.append(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if args.nproc is not None and args.nproc < 1:
        problems.append(f"--nproc {args.nproc} must be >= 1")
    for name in ("lr", "init_timeout", "train_timeout"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            problems.append(f"--{name.replace('_', '-')} {value} must be a finite number > 0")
    if args.max_steps < 0:
        problems.append(f"--max-steps {args.max_steps} must be >= 0")
    if not (
        math.isfinite(args.stall_timeout) and (args.stall_timeout == 0 or args.stall_timeout >= 2)
    ):
        problems.append(f"--stall-timeout {args.stall_timeout} must be 0 (off) or >= 2 seconds")
    for name in ("checkpoint_every", "max_restarts", "check_replicas_every"):
        if getattr(args, name) < 0:
            problems.append(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 0")
    if args.resume not in ("", "auto") and not Path(args.resume).is_dir():
        problems.append(f"--resume {args.resume} is neither 'auto' nor a checkpoint folder")
    problems += wrap_problems(args)
    problems += step_problems(args)
    problems += observe_problems(args)
    problem = _output_dir_problem(Path(args.output_dir))
    if problem:
        problems.append(problem)
    if problems:
        raise ConfigError(f"invalid arguments: {'; '.join(problems)}")
    values = {f.name: getattr(args, f.name) for f in fields(TrainConfig)}
    values["epochs"] = values["epochs"] or TrainConfig.epochs  # None: set from the data in run()
    return TrainConfig(**values)


def _output_dir_problem(path: Path) -> str | None:
    """Why ``path`` cannot be an output folder, checked without creating anything."""
    blocked = unwritable_ancestor(path)
    if blocked is None:
        return None
    probe, why = blocked
    if why == "not a folder":
        return f"--output-dir {path} is not usable: {probe} is a file, not a folder"
    return f"--output-dir {path} is not writable (no write permission on {probe})"


def _worker_argv(args: argparse.Namespace, source: DataSource) -> list[str]:
    """The user's own ``train`` arguments, plus the data source the parent resolved."""
    argv = ["-m", "ddpkit", *args.argv, WORKER_FLAG, "--dataset", source.dataset]
    if source.directory is not None:
        argv += ["--data-dir", str(source.directory)]
    return argv  # argparse keeps the last occurrence of a repeated option


def _train_here(args: argparse.Namespace, config: TrainConfig, source: DataSource) -> int:
    from ddpkit.distributed.process_group import init_runtime
    from ddpkit.log import configure_logging, get_logger

    on = bool(args.stall_timeout)  # 0 = the watchdog off: no stall and no deadlock reports
    with init_runtime(
        args.backend,
        args.init_timeout,
        args.train_timeout,
        stall_timeout_s=args.stall_timeout if on else None,
        deadlock_timeout_s=5.0 if on else None,
    ) as runtime:
        configure_logging(runtime.info)
        if source.note and not args._worker:
            get_logger("train").info(source.note)
        train_mnist(config, runtime, source)
    return 0


def _check_resume(config: TrainConfig, source: DataSource, nproc: int) -> None:
    """Refuse, before any worker starts, a resume that the workers would refuse."""
    if not config.resume:
        return
    directory = Path(config.output_dir) / "checkpoints"
    found = newest_manifest(directory) if config.resume == "auto" else None
    if config.resume != "auto":
        found = (Path(config.resume), read_manifest(Path(config.resume)))
    if found is not None:
        settings = {**resume_settings(config), "dataset": source.dataset}
        check_compatible(found[0], found[1], nproc, settings)


def _fit_to_data(
    config: TrainConfig, source: DataSource, epochs: int | None
) -> tuple[TrainConfig, DataSource]:
    """The data set's epoch count unless ``--epochs`` was given; its note says which (#16)."""
    epochs, source = source.with_epochs(epochs)
    return dataclasses.replace(config, epochs=epochs), source


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    if restarted and config.checkpoint_every:  # a restart continues from the newest, never redoes
        config = dataclasses.replace(config, resume="auto")
    if args._worker:  # a rank started by the launcher below: the parent already resolved data
        source = resolve_data(args.dataset, args.data_dir, download=False)
        return _train_here(args, *_fit_to_data(config, source, args.epochs))
    source = resolve_data(args.dataset, args.data_dir, download=not args.no_download)
    config, source = _fit_to_data(config, source, args.epochs)
    info = detect_process_info()
    one_process = args.strategy in ("single", "dp")  # their default is --nproc 1
    nproc = (
        info.world_size
        if info.is_distributed
        else args.nproc or (1 if one_process else default_nproc())
    )
    check_strategy(config, nproc)
    _check_resume(config, source, nproc)
    make_output_folder(config.output_dir)  # a one-line error where mkdir fails (#16)
    if info.is_distributed:  # torchrun -m ddpkit train, or srun -n 2
        return _train_here(args, config, source)
    if nproc == 1 and not args.max_restarts:  # restarts are torchrun's: those go through it
        return _train_here(args, config, source)
    if source.note:
        print(source.note, flush=True)
    if args.max_restarts and not args.checkpoint_every:
        print(
            "ddpkit train: warning: --max-restarts without --checkpoint-every: a restarted job "
            "starts again from step 0",
            file=sys.stderr,
            flush=True,
        )
    spec = LaunchSpec(
        target=_worker_argv(args, source),
        nproc=nproc,
        max_restarts=args.max_restarts,
        command="ddpkit train",  # failures are labelled with the command the user ran (#16)
        on_interrupt=functools.partial(interrupted_note, config.output_dir, args.argv),  # (#16)
        mem_per_rank_mib=RANK_MEMORY_MIB[source.dataset],  # --nproc that cannot fit: refused
        mem_per_rank_what=f"a ddpkit train rank on {source.dataset}",
    )
    return launch(spec)
