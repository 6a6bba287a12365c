"""Flags and settings shared by ``ddpkit bench overhead`` and ``ddpkit bench scaling``."""

from __future__ import annotations

import argparse
import os

from ddpkit.bench.report import output_problem
from ddpkit.bench.steploop import (
    BASE_FORMS,
    COMPRESSIONS,
    INSTALL_HINT,
    LOCAL_SGD_FORM,
    StepLoopSettings,
    data_description,
    default_num_threads,
    is_installed,
)
from ddpkit.errors import ConfigError

MAX_SAMPLES = 60000  # MNIST training images: the most one run may step through


def check_forms(
    requested: list[str] | None, compression: str | None, local_sgd: bool = False
) -> tuple[list[str], dict[str, str]]:
    """The forms to run, in canonical order, and those skipped with the reason.

    Args:
        requested: the forms asked for (``None``: all, skipping uninstalled optional ones).
        compression: ``fp16``, ``bf16`` or ``powersgd`` adds the form ``ddpkit_<compression>``.
        local_sgd: add the form ``ddpkit_local_sgd`` (after any compression form).

    Raises:
        ConfigError: an unknown form or compression, or a form named explicitly whose package
            is not installed.
    """
    names = list(BASE_FORMS) if requested is None else list(dict.fromkeys(requested))
    problems = [f"unknown form {name!r}" for name in names if name not in BASE_FORMS]
    if compression is not None and compression not in COMPRESSIONS:
        problems.append(f"unknown compression {compression!r}")
    if problems:
        raise ConfigError(
            f"bad forms: {'; '.join(problems)}. Forms: {', '.join(BASE_FORMS)}; compression: "
            f"{', '.join(COMPRESSIONS)}. Fix --forms/--compression."
        )
    missing = [name for name in names if not is_installed(name)]
    if missing and requested is not None:
        raise ConfigError(
            f"form {', '.join(missing)} asked for but {INSTALL_HINT}. Install it, or drop it "
            "from --forms."
        )
    forms = [name for name in BASE_FORMS if name in names and name not in missing]
    if compression is not None:
        forms.append(f"ddpkit_{compression}")
    if local_sgd:
        forms.append(LOCAL_SGD_FORM)
    return forms, {name: INSTALL_HINT for name in missing}


def check_settings(
    settings: StepLoopSettings, max_nproc: int, problems: list[str] | None = None
) -> None:
    """Refuse settings no run can use, all problems (with ``problems`` found by the caller)
    in one line.

    Raises:
        ConfigError: steps < 1, warm-up < 0, batch size < 1, timeout <= 0, a missing
            ``data_dir``, more samples than the MNIST training set holds (:data:`MAX_SAMPLES`,
            with the random data too), or any of ``problems``.
    """
    problems = list(problems or [])
    if settings.num_steps < 1:
        problems.append(f"--steps {settings.num_steps} must be >= 1")
    if settings.num_warmup_steps < 0:
        problems.append(f"--warmup {settings.num_warmup_steps} must be >= 0")
    if settings.batch_size < 1:
        problems.append(f"--batch-size {settings.batch_size} must be >= 1")
    if not settings.timeout_s > 0:
        problems.append(f"--timeout {settings.timeout_s} must be > 0 seconds")
    # one pass over at most MNIST's training set; the random data is held in memory the same
    # way (--steps 100000 would otherwise ask for 40 GB of random images)
    total = (settings.num_steps + settings.num_warmup_steps) * settings.batch_size * max_nproc
    if total > MAX_SAMPLES:
        problems.append(
            f"(--warmup + --steps) x --batch-size x processes = {total} samples exceed "
            f"{MAX_SAMPLES} (MNIST's training set, one pass; the random data has the same "
            "limit): use fewer steps"
        )
    if problems:
        raise ConfigError(f"bad benchmark settings: {'; '.join(problems)}.")
    if settings.data_dir is not None:
        from ddpkit.app.mnist.data import resolve_data

        resolve_data("mnist", settings.data_dir, download=False)  # missing folder/files: exit 2


def add_loop_arguments(parser: argparse.ArgumentParser) -> None:
    """The step-loop flags both benchmarks take (batch, steps, warm-up, rounds, data, output)."""
    defaults = StepLoopSettings()
    parser.add_argument(
        "--batch-size",
        type=int,
        default=defaults.batch_size,
        metavar="B",
        help=f"samples per rank per step (default {defaults.batch_size})",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=defaults.num_steps,
        metavar="K",
        help=f"timed optimizer steps per run (default {defaults.num_steps})",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=defaults.num_warmup_steps,
        metavar="W",
        help=f"untimed steps before them (default {defaults.num_warmup_steps})",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        metavar="R",
        help="rounds; each runs every variant once in fresh processes, the order "
        "rotated each round; medians over rounds are reported (default 5)",
    )
    parser.add_argument(
        "--data-dir",
        metavar="DIR",
        help="train on the MNIST training images in DIR (the four IDX files); "
        "default: random MNIST-shaped tensors",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=defaults.timeout_s,
        metavar="SECONDS",
        help="one run is killed (every rank) after this many seconds "
        f"(default {defaults.timeout_s:g})",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object on stdout instead of the table"
    )
    parser.add_argument("--csv", metavar="PATH", help="also write the rows as CSV to PATH")


def settings_from_args(
    args: argparse.Namespace, max_nproc: int, problems: list[str] | None = None
) -> StepLoopSettings:
    """The :class:`StepLoopSettings` of the flags, checked (threads: cores // ``max_nproc``).

    Raises:
        ConfigError: see :func:`check_settings`; also ``--rounds`` < 1, a ``--csv`` path
            that cannot be written, and ``problems``.
    """
    problems = list(problems or [])
    settings = StepLoopSettings(
        batch_size=args.batch_size,
        num_steps=args.steps,
        num_warmup_steps=args.warmup,
        data_dir=args.data_dir,
        num_threads=default_num_threads(max(1, max_nproc)),
        timeout_s=args.timeout,
    )
    if args.rounds < 1:
        problems.append(f"--rounds {args.rounds} must be >= 1")
    csv_problem = output_problem("--csv", args.csv)
    if csv_problem:
        problems.append(csv_problem)
    check_settings(settings, max_nproc, problems)
    return settings


def settings_record(settings: StepLoopSettings, rounds: int) -> dict:
    """The settings as printed in the report and stored in the JSON."""
    return {
        "batch_size_per_rank": settings.batch_size,
        "num_steps": settings.num_steps,
        "num_warmup_steps": settings.num_warmup_steps,
        "rounds": rounds,
        "omp_num_threads": settings.num_threads,
        "data": data_description(settings),
        "optimizer": f"adam lr={settings.lr:g}",
    }


def settings_line(record: dict) -> str:
    return (
        f"data: {record['data']}; batch {record['batch_size_per_rank']} per rank, "
        f"{record['num_warmup_steps']} warm-up + {record['num_steps']} timed steps, "
        f"{record['rounds']} round(s), OMP_NUM_THREADS={record['omp_num_threads']}"
    )


def oversubscription_note(nproc: int) -> str | None:
    """A note when ``nproc`` CPU processes outnumber the cores (their figures then measure the
    cores being shared, not the training loop); ``None`` with CUDA or enough cores."""
    import torch

    cores = os.cpu_count() or 1
    if torch.cuda.is_available() or nproc <= cores:
        return None
    return (
        f"note: {nproc} processes on {cores} CPU cores: from {cores + 1} processes on, ranks "
        "share cores, so throughput and efficiency there measure the oversubscription"
    )
