"""``ddpkit bench allreduce|overhead|scaling``: one module per benchmark under
:mod:`ddpkit.bench`, each with ``add_arguments(parser)`` and ``run(args) -> exit status``."""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {
    "allreduce": "all-reduce time, algbw and busbw per message size (nccl-tests convention)",
    "overhead": "the MNIST CNN step loop: raw DDP vs ddpkit vs Accelerate/Fabric vs no-sync",
    "scaling": "throughput for 1..N processes and the scaling efficiency",
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
        sub = benches.add_parser(name, help=summary, description=module.__doc__)
        module.add_arguments(sub)
        sub.set_defaults(handler=module.run)
