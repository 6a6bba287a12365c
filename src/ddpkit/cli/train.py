"""``ddpkit train``: the MNIST CNN with DDP on N local processes (the main job).

The command resolves the settings (defaults, then a ``--config`` TOML file, then the flags
given), checks them, and resolves the data *before* any worker starts; then it either launches N
ranks through ``ddpkit run``, handing each the resolved settings as a TOML file, or — when it is
already inside a launched job (``torchrun -m ddpkit train``) — trains in this process.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

# torch-free at import: ``ddpkit train --help`` and flag errors answer without torch; what
# needs torch (the data, the job, the launcher) is imported where it is used
from ddpkit.app.mnist.config import SECTIONS, TrainConfig, check
from ddpkit.checkpoint.lock import check_unlocked
from ddpkit.cli.flags import add_settings_arguments, given_settings
from ddpkit.env import ProcessInfo, detect_process_info
from ddpkit.errors import ConfigError, DataError, add_note
from ddpkit.files import make_output_folder
from ddpkit.launch.config import default_max_restarts
from ddpkit.monitoring.prometheus import check_endpoint
from ddpkit.parallel.choices import runs_in_one_process
from ddpkit.runtime.signals import parse_stop_signals
from ddpkit.settings import field_problems, read_toml, to_toml

if TYPE_CHECKING:
    from ddpkit.app.mnist.data import DataSource

WORKER_FLAG = "--_worker"  # its value: the resolved settings file the parent wrote for its ranks


def default_nproc() -> int:
    """One process per GPU on CUDA, else 2."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train the MNIST CNN with DDP on N local processes",
        description="Train a small CNN on MNIST (1x28x28 inputs, 10 classes) with "
        "DistributedDataParallel. Prints per-epoch train loss, test loss, test accuracy and "
        "samples/s; writes metrics.jsonl/csv, steps.jsonl/csv, summary.json, model.pt and "
        "(with tensorboard installed) tensorboard/ to --output-dir.",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="read settings from a TOML file, one [section] per group below (ddpkit train "
        "--print-config writes one); flags given on the command line override it",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved settings as TOML (a start for --config) and exit",
    )
    add_settings_arguments(
        parser, SECTIONS, notes={"nproc": " (default: one per GPU on CUDA, else 2)"}
    )
    parser.add_argument(WORKER_FLAG, default=None, help=argparse.SUPPRESS)
    parser.set_defaults(handler=run)


def resolve_config(args: argparse.Namespace) -> tuple[TrainConfig, set[str]]:
    """The defaults, overridden by the ``--config`` file, overridden by the flags given; a
    worker takes the file its parent resolved. Not yet checked (see :func:`check`).

    Returns:
        ``(config, names)``: ``names`` are the settings the user set (file or flag); a worker's
        are all set.
    """
    if args._worker:
        values = read_toml(args._worker, SECTIONS)
        return TrainConfig(**values), set(values)
    from_file = read_toml(args.config, SECTIONS) if args.config else {}
    values = {**from_file, **given_settings(args, SECTIONS)}
    return TrainConfig(**values), set(values)


def _fit_to_data(
    config: TrainConfig, source: DataSource, given: set[str]
) -> tuple[TrainConfig, DataSource]:
    """The data set's epoch count unless the user set ``epochs``; the note says which (#16)."""
    epochs, source = source.with_epochs(config.epochs if "epochs" in given else None)
    return dataclasses.replace(config, epochs=epochs), source


def run(args: argparse.Namespace) -> int:
    config, given = resolve_config(args)
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    if restarted and config.checkpoint_every:  # a restart continues from the newest, never redoes
        config = dataclasses.replace(config, resume="auto")
    if args._worker:  # a rank started by the launcher below: the parent already resolved data
        from ddpkit.app.mnist.data import resolve_data

        source = resolve_data(config.dataset, config.data_dir, download=False)
        return _train_here(config, source, worker=True)
    if args.print_config:
        check(config)
        print(to_toml(config, SECTIONS), end="")
        return 0
    if field_problems(config):  # a value wrong on its own: said before torch loads
        check(config)
    return _check_and_start(config, given, restarted=restarted, argv=args.argv)


def _check_and_start(
    config: TrainConfig, given: set[str], *, restarted: bool, argv: list[str]
) -> int:
    """Check ``config`` with the world size, the data, the checkpoint to resume and the output
    folder, before any worker starts; then train in this process or launch the ranks."""
    info = detect_process_info()
    one_process = runs_in_one_process(config.strategy)  # its default is --nproc 1
    nproc = config.nproc or (1 if one_process else default_nproc())
    nproc = info.world_size if info.is_distributed else nproc
    check(config, world_size=nproc)
    # torch from here on (and in default_nproc): a config error above answers without it
    from ddpkit.app.mnist.data import resolve_data
    from ddpkit.app.mnist.outputs import check_fresh_output, checkpoint_folder
    from ddpkit.runtime.process_group import resolve_backend

    here = info if info.is_distributed else ProcessInfo(world_size=nproc, local_world_size=nproc)
    resolve_backend(config.backend, here)  # e.g. nccl without a GPU per rank: before launch
    if config.strategy == "dp":
        from ddpkit.parallel.dp import check_dp_possible

        check_dp_possible(1)  # the CUDA devices: known here, before any worker starts
    source = resolve_data(config.dataset, config.data_dir, download=config.download)
    config, source = _fit_to_data(config, source, given)
    _check_resume(config, source, nproc)
    make_output_folder(config.output_dir)  # a one-line error where mkdir fails (#16)
    check_unlocked(checkpoint_folder(config.output_dir))  # another job's folder: before launch
    if not (config.overwrite or restarted or config.resume not in ("", "auto")):
        # an earlier run is never deleted unasked (--resume auto: unless it has a checkpoint)
        check_fresh_output(config.output_dir, resume_auto=config.resume == "auto")
    if info.is_distributed:  # torchrun -m ddpkit train, or srun -n 2
        return _train_here(config, source, worker=False)
    if "max_restarts" not in given:  # live: replacements by default
        config = dataclasses.replace(
            config, max_restarts=default_max_restarts(config.fault_tolerance)
        )
    if nproc == 1 and not config.max_restarts:  # restarts are torchrun's: those go through it
        return _train_here(config, source, worker=False, argv=argv)
    if config.metrics_port is not None:  # rank 0 would find it after every rank started
        check_endpoint(config.metrics_port, config.metrics_host)
    return _launch(config, source, nproc, argv=argv)


def _launch(config: TrainConfig, source: DataSource, nproc: int, *, argv: list[str]) -> int:
    """Start ``nproc`` ranks that each read the settings resolved here (data source included)."""
    from ddpkit.app.mnist.data import RANK_MEMORY_MIB
    from ddpkit.app.mnist.resume import interrupted_note
    from ddpkit.launch.launcher import launch
    from ddpkit.launch.spec import spec_of

    if source.note:
        print(source.note, flush=True)
    if config.max_restarts and not config.checkpoint_every:
        print(
            "ddpkit train: warning: --max-restarts without --checkpoint-every: a restarted job "
            "starts again from step 0",
            file=sys.stderr,
            flush=True,
        )
    directory = None if source.directory is None else str(source.directory)
    resolved = dataclasses.replace(
        config, nproc=nproc, dataset=source.dataset, data_dir=directory, download=False
    )
    with (
        tempfile.TemporaryDirectory(prefix="ddpkit-train-") as folder,
        _compile_cache_in(folder, compile=config.compile),
    ):
        path = Path(folder) / "config.toml"
        path.write_text(to_toml(resolved, SECTIONS))
        target = ["-m", "ddpkit", "train", WORKER_FLAG, str(path)]
        spec = spec_of(
            resolved,  # its launch settings, with nproc resolved
            target,
            command="ddpkit train",  # failures are labelled with the command the user ran (#16)
            on_interrupt=functools.partial(interrupted_note, config.output_dir, argv),
            mem_per_rank_mib=RANK_MEMORY_MIB[source.dataset],  # --nproc that cannot fit: refused
            mem_per_rank_what=f"a ddpkit train rank on {source.dataset}",
            preload=("ddpkit.app.mnist.job", "ddpkit.cli.train"),
        )
        if config.fault_tolerance == "live":
            from ddpkit.launch.live import launch_live

            return launch_live(spec)
        return launch(spec)


@contextlib.contextmanager
def _compile_cache_in(folder: str, *, compile: bool) -> Iterator[None]:
    """Without ``--compile``, the ranks' ``TORCHINDUCTOR_CACHE_DIR`` is inside ``folder`` (the
    job's own, removed with it): torch makes its compile cache folder,
    ``$TMPDIR/torchinductor_<user>``, as soon as the optimizer imports ``torch._dynamo``, and
    leaves it behind empty. With ``--compile``, or the variable set, torch's cache is kept: the
    next run compiles from it."""
    if compile or "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        yield
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(folder, "torchinductor")
    try:
        yield
    finally:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)


def _train_here(
    config: TrainConfig, source: DataSource, *, worker: bool, argv: list[str] | None = None
) -> int:
    from ddpkit.app.mnist.job import train_mnist
    from ddpkit.app.mnist.resume import resume_note, stop_note
    from ddpkit.log import configure_logging, get_logger
    from ddpkit.runtime.process_group import init_runtime
    from ddpkit.runtime.stop import TrainingStopped

    on = bool(config.stall_timeout)  # 0 = the watchdog off: no stall and no deadlock reports
    with init_runtime(
        config.backend,
        init_timeout_s=config.init_timeout,
        train_timeout_s=config.train_timeout,
        stall_timeout_s=config.stall_timeout if on else None,
        deadlock_timeout_s=5.0 if on else None,
        stop_signals=parse_stop_signals(config.stop_signals),
        fault_tolerance=config.fault_tolerance,
    ) as runtime:
        configure_logging(runtime.info)
        if source.note and not worker:
            get_logger("train").info(source.note)
        try:
            train_mnist(config, runtime, source)
        except TrainingStopped as stopped:
            if worker:  # the bootstrap records it; the launcher prints the one line
                raise
            if runtime.is_rank_zero:
                print(stop_note(stopped, config.output_dir, argv or []), file=sys.stderr)
            return stopped.code
        except Exception as exc:  # one process: no launcher names the checkpoint, this does
            refused = isinstance(exc, (ConfigError, DataError))  # a resume would fail alike
            note = "" if refused else resume_note(config.output_dir, argv or [])
            if note and not worker and runtime.is_rank_zero:
                add_note(exc, note)  # `ddpkit train: error: ...; <note>`, or under a traceback
            raise
    return 0


def _check_resume(config: TrainConfig, source: DataSource, nproc: int) -> None:
    """Refuse, before any worker starts, a resume that the workers would refuse: settings that
    differ from the checkpoint's, or a global batch that cannot split over ``nproc``. (The
    workers split it the same way; rank 0 says how.)"""
    from ddpkit.app.mnist.resume import (
        check_strategy,
        check_written_by_train,
        checkpoint_settings,
        plan_batch,
    )
    from ddpkit.checkpoint.manager import check_compatible

    if not config.resume:
        return
    plan = plan_batch(config, nproc)
    if plan.found is None:
        return
    run_config = dataclasses.replace(config, batch_size=plan.batch_size, grad_accum=plan.grad_accum)
    check(run_config, world_size=nproc)  # e.g. a static graph with the micro-steps chosen here
    folder, manifest = plan.found
    check_written_by_train(folder, manifest)
    check_compatible(folder, manifest, checkpoint_settings(run_config, source.dataset, plan))
    check_strategy(config, plan)
