"""``ddpkit run -n N [--] script.py [args...]``: start N ranks on this node through torchrun."""

from __future__ import annotations

import argparse

from ddpkit.launch.launcher import LaunchSpec, launch

EPILOG = """examples:
  ddpkit run -n 2 train.py --epochs 3
  ddpkit run -n 2 -m mypackage.train --lr 0.1
Equivalent plain torchrun: torchrun --standalone --nproc-per-node 2 train.py --epochs 3
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="launch a script on N local processes (torchrun underneath)",
        description="Start N ranks of SCRIPT on this node with torch.distributed.run (standalone "
        "rendezvous on a port the OS picks). If one rank fails, all are stopped and the last "
        "lines name the rank that failed first.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-n",
        "--nproc",
        type=int,
        required=True,
        metavar="N",
        help="number of processes (ranks) to start",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="R",
        help="restart all workers up to R times after a failure (default 0)",
    )
    parser.add_argument(
        "--omp-num-threads",
        type=int,
        default=None,
        metavar="T",
        help="threads per process (default: OMP_NUM_THREADS if set, else usable cores // N)",
    )
    parser.add_argument(
        "-m",
        "--module",
        default=None,
        metavar="MODULE",
        help="run MODULE as __main__ (like python -m) instead of a script",
    )
    parser.add_argument(
        "target",
        nargs=argparse.REMAINDER,
        metavar="script.py [args...]",
        help="the script and its arguments (the module's arguments with -m)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    target = list(args.target)
    if target[:1] == ["--"]:
        target = target[1:]
    if args.module:
        target = ["-m", args.module, *target]
    spec = LaunchSpec(
        target=target,
        nproc=args.nproc,
        max_restarts=args.max_restarts,
        omp_num_threads=args.omp_num_threads,
    )
    return launch(spec)
