"""``ddpkit bench memory``: per-rank memory and speed of ``ddp``, ``zero1`` and ``fsdp``.

    ddpkit bench memory                                  # 1..3 processes, a 50.4 M-parameter MLP
    ddpkit bench memory --max-nproc 2 --width 1024 --rounds 1 --json

The same work in every run: an MLP of ``--depth`` ``Linear(W, W)`` layers (``--width`` W;
12 x 2048 gives 50.4 M parameters; 12 equal layers split evenly over 2 and 3 ranks, which
matters to ``zero1``: ``ZeroRedundancyOptimizer`` gives each rank whole parameters), AdamW,
``--batch-size`` random samples per rank per step, through ddpkit's ``wrap_model`` and
``TrainStep`` (see :mod:`ddpkit.bench.sharded_worker`). Per strategy and number of processes
it reports, for the largest rank: the bytes of its parameters, gradients and optimizer state
(from the tensors: ``numel * element_size`` of its shards), its peak and final RSS (from one
more run each, where glibc gives freed blocks of 1 MiB and more back to the system: otherwise
RSS keeps what was ever allocated, the full model before FSDP shards it), the collective
payload of one step, and the median samples/s over rounds with the median per-round ratio to
``ddp`` at the same number of processes. At 1 process every strategy is the plain module
(``single``), run once. The goals of issue #15 are checked and printed: ``fsdp``'s parameter +
gradient + optimizer bytes at most ``1/N`` of ``ddp``'s + 5%, ``zero1``'s optimizer state at
most ``1/N`` + 5%.

Each round runs every (strategy, processes) once in fresh processes, the order rotated.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from ddpkit.bench.overhead import rotated
from ddpkit.bench.report import (
    format_table,
    machine,
    machine_line,
    median,
    output_problem,
    write_csv,
)
from ddpkit.bench.sharded_worker import STRATEGIES, MemorySettings, memory_worker
from ddpkit.bench.steploop import default_num_threads, run_ranks
from ddpkit.errors import ConfigError

GOAL_SLACK = 0.05  # issue #15: at most 1/N of ddp's bytes + 5 %
MIB = 2**20
COLUMNS = (
    ("strategy", "strategy", "s"),
    ("nproc", "processes", "d"),
    ("param_mib", "params MiB", ".1f"),
    ("grad_mib", "grads MiB", ".1f"),
    ("optimizer_mib", "optim MiB", ".1f"),
    ("state_fraction_of_ddp", "p+g+o / ddp", ".3f"),
    ("peak_rss_mib", "peak RSS MiB", ".0f"),
    ("rss_end_mib", "RSS end MiB", ".0f"),
    ("comm_mib_per_step", "comm MiB/step", ".1f"),
    ("samples_per_s", "samples/s", ".2f"),
    ("ratio_to_ddp", "x ddp", ".3f"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = MemorySettings()
    parser.add_argument(
        "--max-nproc", type=int, default=3, metavar="N", help="measure 1..N processes (default 3)"
    )
    parser.add_argument(
        "--strategies",
        nargs="+",
        default=list(STRATEGIES),
        metavar="S",
        help=f"of {', '.join(STRATEGIES)} (default: all)",
    )
    for flag, value, help_text in (
        ("--width", defaults.width, "features of each Linear layer"),
        ("--depth", defaults.depth, "Linear(width, width) layers"),
        ("--batch-size", defaults.batch_size, "samples per rank per step"),
        ("--steps", defaults.num_steps, "timed optimizer steps per run"),
        ("--warmup", defaults.num_warmup_steps, "untimed steps before them"),
        ("--rounds", 3, "rounds; each runs every strategy and size once, rotated"),
    ):
        parser.add_argument(
            flag, type=int, default=value, metavar="N", help=f"{help_text} (default {value})"
        )
    parser.add_argument(
        "--timeout",
        type=float,
        default=defaults.timeout_s,
        metavar="SECONDS",
        help="one run is killed after this many seconds",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument("--csv", metavar="PATH", help="also write the rows as CSV to PATH")


def _settings(args: argparse.Namespace) -> MemorySettings:
    """The settings of the flags, checked.

    Raises:
        ConfigError: every bad value in one line.
    """
    problems = [f"unknown strategy {s!r}" for s in args.strategies if s not in STRATEGIES]
    for flag, value, least in (
        ("--max-nproc", args.max_nproc, 1),
        ("--width", args.width, 1),
        ("--depth", args.depth, 1),
        ("--batch-size", args.batch_size, 1),
        ("--steps", args.steps, 1),
        ("--warmup", args.warmup, 1),
        ("--rounds", args.rounds, 1),
    ):
        if value < least:
            problems.append(f"{flag} {value} must be >= {least}")
    if not args.timeout > 0:
        problems.append(f"--timeout {args.timeout} must be > 0 seconds")
    csv_problem = output_problem("--csv", args.csv)
    problems += [csv_problem] if csv_problem else []
    if problems:
        raise ConfigError(
            f"bad benchmark settings: {'; '.join(problems)}. Strategies: "
            f"{', '.join(STRATEGIES)} (--warmup >= 1: the optimizer state exists after a step)."
        )
    return MemorySettings(
        width=args.width,
        depth=args.depth,
        batch_size=args.batch_size,
        num_steps=args.steps,
        num_warmup_steps=args.warmup,
        num_threads=default_num_threads(args.max_nproc),
        timeout_s=args.timeout,
    )


def run_one(strategy: str, nproc: int, settings: MemorySettings) -> dict:
    """One run on ``nproc`` fresh processes: the largest rank's figures and the samples/s.

    Raises:
        DistributedError: a rank failed, died or timed out (one line naming the run).
    """
    ranks = run_ranks(
        memory_worker,
        nproc,
        args=(strategy, settings),
        timeout_s=settings.timeout_s,
        pg_timeout_s=min(settings.timeout_s, 300.0),
        what=strategy,
        hint="Rerun it alone with --strategies and --max-nproc to see it.",
    )
    largest = {
        k: max(r[k] for r in ranks)
        for k in (
            "param_bytes",
            "grad_bytes",
            "optimizer_bytes",
            "peak_rss_mib",
            "rss_start_mib",
            "rss_end_mib",
        )
    }
    comm = sum(ranks[0]["comm_bytes_per_step"].values())
    samples = nproc * settings.batch_size * settings.num_steps
    return {
        **largest,
        "comm_bytes_per_step": comm,
        "comm_by_op": ranks[0]["comm_bytes_per_step"],
        "samples_per_s": samples / max(r["seconds"] for r in ranks),
    }


def _runs(strategies: list[str], max_nproc: int) -> list[tuple[str, int]]:
    one = [("single", 1)]
    return one + [(s, n) for n in range(2, max_nproc + 1) for s in strategies]


def measure_rss(runs: list[tuple[str, int]], settings: MemorySettings) -> dict:
    """One more run of each, with freed memory given back to the system (see
    :func:`ddpkit.bench.sharded_worker._return_freed_memory`): its peak and final RSS."""
    held = dataclasses.replace(settings, return_freed_memory=True)
    rss = {}
    for strategy, nproc in runs:
        result = run_one(strategy, nproc, held)
        rss[(strategy, nproc)] = {k: result[k] for k in ("peak_rss_mib", "rss_end_mib")}
        print(
            f"memory run: {strategy} x {nproc}: peak RSS {result['peak_rss_mib']:.0f} MiB",
            file=sys.stderr,
        )
    return rss


def measure(runs: list[tuple[str, int]], settings: MemorySettings, rounds: int) -> list[dict]:
    per_round = []
    for index in range(rounds):
        results = {}
        for strategy, nproc in rotated(runs, index):
            results[(strategy, nproc)] = run_one(strategy, nproc, settings)
            rate = results[(strategy, nproc)]["samples_per_s"]
            print(
                f"round {index + 1}/{rounds}: {strategy} x {nproc}: {rate:.2f} samples/s",
                file=sys.stderr,
            )
        per_round.append(results)
    return per_round


def summarize(per_round: list[dict], runs: list[tuple[str, int]], rss: dict) -> list[dict]:
    """One row per run: the last round's bytes (they do not vary), the memory run's RSS
    (``rss``), the median rates, the fractions of ``ddp``'s bytes and the per-round throughput
    ratio to ``ddp``."""
    rows = []
    for strategy, nproc in runs:
        last = per_round[-1][(strategy, nproc)]
        row = {
            "strategy": strategy,
            "nproc": nproc,
            "param_mib": last["param_bytes"] / MIB,
            "grad_mib": last["grad_bytes"] / MIB,
            "optimizer_mib": last["optimizer_bytes"] / MIB,
            **rss[(strategy, nproc)],
            "peak_rss_mib_default_malloc": median(
                [r[(strategy, nproc)]["peak_rss_mib"] for r in per_round]
            ),
            "comm_mib_per_step": last["comm_bytes_per_step"] / MIB,
            "comm_by_op_mib": {k: v / MIB for k, v in last["comm_by_op"].items()},
            "samples_per_s": median([r[(strategy, nproc)]["samples_per_s"] for r in per_round]),
        }
        reference = ("ddp", nproc) if ("ddp", nproc) in runs else None
        if reference is not None:
            ddp = per_round[-1][reference]
            total = sum(last[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes"))
            ddp_total = sum(ddp[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes"))
            row["state_fraction_of_ddp"] = total / ddp_total
            row["optimizer_fraction_of_ddp"] = last["optimizer_bytes"] / ddp["optimizer_bytes"]
            row["ratio_to_ddp"] = median(
                [
                    r[(strategy, nproc)]["samples_per_s"] / r[reference]["samples_per_s"]
                    for r in per_round
                ]
            )
        rows.append(row)
    return rows


def goals(rows: list[dict]) -> list[str]:
    """One line per goal of issue #15 and whether it is met (from the rows)."""
    lines = []
    for row in rows:
        n, limit = row["nproc"], 1 / row["nproc"] + GOAL_SLACK
        if row["strategy"] == "fsdp" and "state_fraction_of_ddp" in row:
            value = row["state_fraction_of_ddp"]
            lines.append(
                f"fsdp x {n}: params+grads+optimizer {value:.3f} of ddp's (goal <= "
                f"{limit:.3f}): {'met' if value <= limit else 'NOT met'}"
            )
        if row["strategy"] == "zero1" and "optimizer_fraction_of_ddp" in row:
            value = row["optimizer_fraction_of_ddp"]
            lines.append(
                f"zero1 x {n}: optimizer state {value:.3f} of ddp's (goal <= "
                f"{limit:.3f}): {'met' if value <= limit else 'NOT met'}"
            )
    return lines


def run(args: argparse.Namespace) -> int:
    settings = _settings(args)
    strategies = [s for s in STRATEGIES if s in args.strategies]
    if args.max_nproc > 1 and "ddp" not in strategies:
        strategies = ["ddp", *strategies]  # the reference of every ratio
    runs = _runs(strategies, args.max_nproc)
    rss = measure_rss(runs, settings)
    per_round = measure(runs, settings, args.rounds)
    rows = summarize(per_round, runs, rss)
    record = {
        "width": settings.width,
        "depth": settings.depth,
        "num_parameters": settings.num_parameters,
        "batch_size_per_rank": settings.batch_size,
        "num_steps": settings.num_steps,
        "num_warmup_steps": settings.num_warmup_steps,
        "rounds": args.rounds,
        "omp_num_threads": settings.num_threads,
        "optimizer": "adamw",
    }
    if args.csv:
        keys = [key for key, _, _ in COLUMNS] + ["optimizer_fraction_of_ddp"]
        write_csv(Path(args.csv), [{k: r.get(k) for k in keys} for r in rows])
    if args.json:
        payload = {"rows": rows, "goals": goals(rows), "machine": machine(), "settings": record}
        print(json.dumps(payload, indent=2, allow_nan=False))
        return 0
    print(machine_line())
    print(
        f"model: {settings.depth} x Linear({settings.width}, {settings.width}) + ReLU = "
        f"{settings.num_parameters / 1e6:.1f} M parameters, AdamW; batch "
        f"{settings.batch_size} per rank, {settings.num_warmup_steps} warm-up + "
        f"{settings.num_steps} timed steps, {args.rounds} round(s), "
        f"OMP_NUM_THREADS={settings.num_threads}"
    )
    print(format_table(rows, COLUMNS))
    for line in goals(rows):
        print(line)
    return 0
