"""``ddpkit bench overhead``: the MNIST CNN step loop as raw DDP, ddpkit, Accelerate, Lightning
Fabric and the no-sync ceiling, interleaved in one command.

    ddpkit bench overhead                          # 2 processes, 5 rounds, random data
    ddpkit bench overhead --compression fp16 --json
    ddpkit bench overhead --forms raw_ddp ddpkit no_sync --sync-every 8
    ddpkit bench overhead --forms raw_ddp ddpkit --rounds 9 --data-dir ../shared/data/mnist

Each round runs every form once, in fresh processes, the order rotated each round. Per form it
reports the median samples/s over rounds and the median over rounds of that round's ratio to
raw DDP and to the no-sync ceiling (the same loop with gradient sync off: what a step costs
without any communication). See :mod:`ddpkit.bench.steploop` for what each form runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import TypeVar

from ddpkit.bench import options, steploop
from ddpkit.bench.report import format_table, machine, machine_line, median, write_csv
from ddpkit.bench.steploop import LOCAL_SGD_FORM
from ddpkit.errors import ConfigError

_T = TypeVar("_T")  # what rotated() orders: form names, (strategy, nproc) runs

COLUMNS = (
    ("form", "form", "s"),
    ("samples_per_s", "samples/s (median)", ".1f"),
    ("ratio_to_raw_ddp", "x raw DDP", ".3f"),
    ("ratio_to_no_sync", "x no-sync", ".3f"),
    ("replicas", "replicas", "s"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nproc", type=int, default=2, metavar="N", help="processes (ranks), >= 2 (default 2)"
    )
    parser.add_argument(
        "--forms",
        nargs="+",
        metavar="FORM",
        help=f"run only these of {', '.join(steploop.BASE_FORMS)} (default: all installed)",
    )
    parser.add_argument(
        "--compression",
        choices=steploop.COMPRESSIONS,
        help="also run ddpkit with this gradient compression (form ddpkit_<name>; "
        "as ddpkit train --grad-compression)",
    )
    parser.add_argument(
        "--sync-every",
        type=int,
        metavar="H",
        help="also run ddpkit with local SGD, parameters averaged every H >= 2 steps (form "
        "ddpkit_local_sgd; as ddpkit train --sync-every H)",
    )
    options.add_loop_arguments(parser)


def rotated(forms: list[_T], round_index: int) -> list[_T]:
    """The order of round ``round_index`` (0-based): ``forms`` rotated left that many times."""
    shift = round_index % len(forms)
    return forms[shift:] + forms[:shift]


def summarize(per_round: list[dict[str, dict]], forms: list[str]) -> dict[str, dict]:
    """Medians over rounds: samples/s, and the per-round ratios to raw_ddp and to no_sync.

    Args:
        per_round: one ``{form: run_form result}`` per round.
        forms: the forms that ran.

    Returns:
        ``{form: {"samples_per_s", "ratio_to_raw_ddp", "ratio_to_no_sync",
        "samples_per_s_per_round", "param_checksum_per_rank"}}``; a ratio is ``None`` when its
        reference form did not run.
    """
    summary = {}
    for form in forms:
        rates = [results[form]["samples_per_s"] for results in per_round]

        def ratio(reference: str, form: str = form) -> float | None:
            if reference not in forms:
                return None
            return median(
                [r[form]["samples_per_s"] / r[reference]["samples_per_s"] for r in per_round]
            )

        summary[form] = {
            "samples_per_s": median(rates),
            "ratio_to_raw_ddp": ratio("raw_ddp"),
            "ratio_to_no_sync": ratio("no_sync"),
            "samples_per_s_per_round": rates,
            "param_checksum_per_rank": per_round[-1][form]["param_checksums"],
        }
    return summary


def measure(
    forms: list[str], nproc: int, settings: steploop.StepLoopSettings, rounds: int
) -> list[dict[str, dict]]:
    """Run every form once per round, order rotated each round; progress goes to stderr."""
    per_round = []
    for index in range(rounds):
        results = {}
        for form in rotated(forms, index):
            results[form] = steploop.run_form(form, nproc, settings)
            rate = results[form]["samples_per_s"]
            print(f"round {index + 1}/{rounds}: {form} {rate:.1f} samples/s", file=sys.stderr)
        per_round.append(results)
    return per_round


def _replicas(checksums: list[float]) -> str:
    return "equal" if len(set(checksums)) == 1 else "differ"


def run(args: argparse.Namespace) -> int:
    forms, skipped = options.check_forms(
        args.forms, args.compression, local_sgd=args.sync_every is not None
    )
    problems = []
    if args.sync_every is not None and args.sync_every < 2:
        problems.append(f"--sync-every {args.sync_every} must be >= 2 (1 is plain DDP)")
    if args.nproc < 2:  # overhead compares gradient sync between processes
        problems.append(f"--nproc {args.nproc} must be >= 2 (for 1 process: bench scaling)")
    settings = options.settings_from_args(args, max(args.nproc, 1), problems)
    if args.sync_every is not None:
        settings = dataclasses.replace(settings, local_sgd_period=args.sync_every)
    if not forms:
        raise ConfigError("no form to run: every form asked for is skipped. Check --forms.")
    note = options.oversubscription_note(args.nproc)
    if note:
        print(note, file=sys.stderr)
    per_round = measure(forms, args.nproc, settings, args.rounds)
    summary = summarize(per_round, forms)
    record = {**options.settings_record(settings, args.rounds), "nproc": args.nproc}
    if LOCAL_SGD_FORM in forms:
        record["local_sgd_period"] = settings.local_sgd_period
    rows = [{"form": form, **values} for form, values in summary.items()]
    if args.csv:
        write_csv(Path(args.csv), [_csv_row(row) for row in rows])
    if args.json:
        payload = {**summary, "machine": machine(), "settings": record, "skipped": skipped}
        print(json.dumps(payload, indent=2, allow_nan=False))
        return 0
    print(machine_line())
    period = record.get("local_sgd_period")
    local_sgd = f", ddpkit_local_sgd averages every {period} steps" if period else ""
    print(f"{options.settings_line(record)}, {args.nproc} processes{local_sgd}")
    table_rows = [{**row, "replicas": _replicas(row["param_checksum_per_rank"])} for row in rows]
    print(format_table(table_rows, COLUMNS))
    for form, reason in skipped.items():
        print(f"{form}: skipped ({reason})")
    return 0


def _csv_row(row: dict) -> dict:
    rates = row["samples_per_s_per_round"]
    return {
        "form": row["form"],
        "samples_per_s": row["samples_per_s"],
        "ratio_to_raw_ddp": row["ratio_to_raw_ddp"],
        "ratio_to_no_sync": row["ratio_to_no_sync"],
        "samples_per_s_per_round": " ".join(f"{rate:.3f}" for rate in rates),
    }
