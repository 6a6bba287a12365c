"""``ddpkit bench scaling``: throughput of the MNIST CNN step loop on 1..N processes.

    ddpkit bench scaling                       # ddpkit's loop on 1 and 2 processes, 5 rounds
    ddpkit bench scaling --max-nproc 4 --form raw_ddp --json

Weak scaling: the batch per rank stays fixed (``--batch-size``), so n processes do n times the
work of one, and efficiency(n) = throughput(n) / (n * throughput(1)) (1.0 = perfect). Every
process gets the same number of threads (cores // N, at least 1) whatever n is, so the per-rank
compute is the same and the gap below 1.0 is what gradient sync (and sharing the machine) costs.
At n = 1 there is no process group: ddpkit's ``wrap_model`` returns the plain model, and the raw
loop uses the plain model too. Each round runs every n once in fresh processes, the order
rotated; medians over rounds are reported.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ddpkit.bench import options, steploop
from ddpkit.bench.report import format_table, machine, machine_line, median, write_csv

FORMS = ("ddpkit", "raw_ddp")
COLUMNS = (
    ("nproc", "processes", "d"),
    ("samples_per_s", "samples/s (median)", ".1f"),
    ("samples_per_s_per_rank", "per rank", ".1f"),
    ("efficiency", "efficiency", ".3f"),
)


def default_max_nproc() -> int:
    """2 on CPU; the number of CUDA devices (at least 1) where CUDA is available."""
    import torch

    return max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-nproc",
        type=int,
        default=None,
        metavar="N",
        help="measure 1..N processes (default 2 on CPU, the GPU count on CUDA)",
    )
    parser.add_argument(
        "--form",
        default="ddpkit",
        help="the step loop to scale: ddpkit (default) or raw_ddp (see ddpkit bench overhead)",
    )
    options.add_loop_arguments(parser)


def scaling_rows(rates: dict[int, list[float]]) -> list[dict]:
    """Rows of the report from ``{nproc: samples/s per round}``.

    Returns:
        One row per n: ``nproc``, ``samples_per_s`` (median over rounds),
        ``samples_per_s_per_rank``, ``efficiency`` = median(n) / (n * median(1)),
        ``samples_per_s_per_round``.
    """
    base = median(rates[1])
    rows = []
    for nproc, per_round in sorted(rates.items()):
        throughput = median(per_round)
        rows.append(
            {
                "nproc": nproc,
                "samples_per_s": throughput,
                "samples_per_s_per_rank": throughput / nproc,
                "efficiency": throughput / (nproc * base),
                "samples_per_s_per_round": per_round,
            }
        )
    return rows


def run(args: argparse.Namespace) -> int:
    max_nproc = default_max_nproc() if args.max_nproc is None else args.max_nproc
    problems = []
    if args.form not in FORMS:
        problems.append(f"--form {args.form!r} is not one of {', '.join(FORMS)}")
    if max_nproc < 1:
        problems.append(f"--max-nproc {max_nproc} must be >= 1")
    settings = options.settings_from_args(args, max(max_nproc, 1), problems)
    note = options.oversubscription_note(max_nproc)
    if note:
        print(note, file=sys.stderr)
    counts = list(range(1, max_nproc + 1))
    rates: dict[int, list[float]] = {nproc: [] for nproc in counts}
    for index in range(args.rounds):
        shift = index % len(counts)
        for nproc in counts[shift:] + counts[:shift]:
            rate = steploop.run_form(args.form, nproc, settings)["samples_per_s"]
            rates[nproc].append(rate)
            print(
                f"round {index + 1}/{args.rounds}: {nproc} process(es) {rate:.1f} samples/s",
                file=sys.stderr,
            )
    rows = scaling_rows(rates)
    record = {**options.settings_record(settings, args.rounds), "form": args.form}
    if args.csv:
        flat = [{**row, "samples_per_s_per_round": _joined(row)} for row in rows]
        write_csv(Path(args.csv), flat)
    if args.json:
        payload = {"rows": rows, "machine": machine(), "settings": record}
        print(json.dumps(payload, indent=2, allow_nan=False))
        return 0
    print(machine_line())
    print(f"{options.settings_line(record)}, form {args.form}, weak scaling (batch per rank fixed)")
    print(format_table(rows, COLUMNS))
    return 0


def _joined(row: dict) -> str:
    return " ".join(f"{rate:.3f}" for rate in row["samples_per_s_per_round"])
