"""``ddpkit bench allreduce|overhead|scaling``: one module per benchmark under
:mod:`ddpkit.bench`, each with ``add_arguments(parser)`` and ``run(args) -> exit status``."""

from __future__ import annotations

import argparse
import importlib
import re

BENCHMARKS = {
    "allreduce": "all-reduce time, algbw and busbw per message size (nccl-tests convention)",
    "overhead": "the MNIST CNN step loop: raw DDP vs ddpkit vs Accelerate/Fabric vs no-sync",
    "scaling": "throughput for 1..N processes and the scaling efficiency",
    "memory": "per-rank parameter, gradient and optimizer bytes, peak RSS and speed of ddp, "
    "zero1 and fsdp",
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="measure all-reduce bandwidth, step-loop overhead and scaling",
        description="Benchmarks run side by side in one command (interleaved, medians, "
        "ratios). Every report names the machine it ran on.",
    )
    benches = parser.add_subparsers(
        dest="benchmark", required=True, parser_class=type(parser), metavar="BENCHMARK"
    )
    for name, summary in BENCHMARKS.items():
        module = importlib.import_module(f"ddpkit.bench.{name}")
        sub = benches.add_parser(
            name,
            help=summary,
            description=plain_text(module.__doc__ or ""),
            formatter_class=argparse.RawDescriptionHelpFormatter,  # keep the example lines
        )
        module.add_arguments(sub)
        sub.set_defaults(handler=module.run)


def plain_text(docstring: str) -> str:
    """A module docstring as ``--help`` text: reST markup removed, line breaks kept.

    Example:
        >>> plain_text("``ddpkit bench``: see :mod:`ddpkit.bench.steploop`.")
        'ddpkit bench: see ddpkit.bench.steploop.'
    """
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", docstring)  # :mod:`x.y` -> x.y
    return text.replace("``", "").strip()
