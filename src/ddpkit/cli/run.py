"""``ddpkit run -n N [--] script.py [args...]``: start N ranks on this node through torchrun."""

from __future__ import annotations

import argparse
import shlex

from ddpkit.errors import ConfigError
from ddpkit.launch.elastic import RDZV_CONF_KEYS
from ddpkit.launch.spec import LaunchSpec, validate_spec
from ddpkit.runtime.signals import parse_stop_signals

ELASTIC_MAX_RESTARTS = 3
LIVE_MAX_RESTARTS = 3

EPILOG = """examples:
  ddpkit run -n 2 train.py --epochs 3
  ddpkit run -n 2 -m mypackage.train --lr 0.1
  # two nodes, on each (node 0 owns 10.0.0.1; same command, its own --node-rank):
  ddpkit run -n 2 --nnodes 2 --node-rank 0 --rdzv-endpoint 10.0.0.1:29400 train.py
  # elastic: 2 to 3 nodes; a lost node's survivors restart (up to 3 times) and go on
  ddpkit run -n 1 --nnodes 2:3 --node-rank 0 --rdzv-endpoint 10.0.0.1:29400 train.py
  # live fault tolerance: a lost rank's peers keep training; a spare heals from them
  ddpkit run -n 3 --fault-tolerance live --spares 1 train.py
One node listens on 127.0.0.1 only. Set DDPKIT_JOB_TOKEN (or DDPKIT_JOB_TOKEN_FILE) to the same
secret on every node to admit only processes that hold it.
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
        default=None,
        metavar="R",
        help="restart all workers up to R times after a failure (default 0; elastic "
        f"--nnodes MIN:MAX: {ELASTIC_MAX_RESTARTS}, one per node lost; --fault-tolerance live: "
        f"R replacement processes, default {LIVE_MAX_RESTARTS})",
    )
    parser.add_argument(
        "--omp-num-threads",
        type=int,
        default=None,
        metavar="T",
        help="threads per process (default: OMP_NUM_THREADS if set, else usable cores // N)",
    )
    add_fault_tolerance_arguments(parser)
    _add_stop_arguments(parser)
    _add_node_arguments(parser)
    parser.add_argument(  # REMAINDER: the module's own flags (-m pkg.train --lr 0.1) are its
        "-m",
        "--module",
        nargs=argparse.REMAINDER,
        default=None,
        help="MODULE [args...]: run MODULE as __main__ (like python -m) instead of a script; "
        "everything after MODULE goes to it",
    )
    parser.add_argument(
        "target",
        nargs=argparse.REMAINDER,
        metavar="script.py [args...]",
        help="the script and its arguments (the module's arguments with -m)",
    )
    parser.set_defaults(handler=run)


def add_fault_tolerance_arguments(parser: argparse.ArgumentParser) -> None:
    """``--fault-tolerance`` and ``--spares`` (see docs/fault-tolerance.md)."""
    parser.add_argument(
        "--fault-tolerance",
        choices=("restart", "live"),
        default="restart",
        help="restart: a failed rank stops every rank (restarted with --max-restarts, resuming "
        "the newest checkpoint); live: the others keep training and a replacement heals from "
        "them (one node; the script trains through ddpkit.TrainStep). Default restart",
    )
    parser.add_argument(
        "--spares",
        type=int,
        default=0,
        metavar="S",
        help="live: start S warm spares (torch already imported) that take over lost ranks",
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="live: a rank whose heartbeat stops this long (SIGSTOP, a frozen host) is declared "
        "dead and ended; its peers go on (default 10)",
    )


def _add_stop_arguments(parser: argparse.ArgumentParser) -> None:
    """The stop signals and the grace period (see docs/preemption.md)."""
    parser.add_argument(
        "--grace-period",
        type=int,
        default=30,
        metavar="SECONDS",
        help="after a stop signal, seconds the ranks have to finish their step and save "
        "before they are killed (torchrun's --shutdown-timeout; default 30)",
    )
    parser.add_argument(
        "--stop-signals",
        default="SIGTERM,SIGINT,SIGUSR1",
        metavar="SIGNALS",
        help="signals passed on to every rank, which stop after the same step when the script "
        "uses ddpkit's runtime (default SIGTERM,SIGINT,SIGUSR1; none = only torchrun's own)",
    )


def _add_node_arguments(parser: argparse.ArgumentParser) -> None:
    """Several nodes (rendezvous) and gloo's TLS."""
    parser.add_argument(
        "--nnodes",
        default="1",
        metavar="N|MIN:MAX",
        help="number of nodes; MIN:MAX for elastic membership (a lost node's survivors go on "
        "from the newest checkpoint, a node that joins is taken in)",
    )
    parser.add_argument(
        "--node-rank",
        type=int,
        default=0,
        metavar="R",
        help="this node's index, 0..N-1; node 0 hosts the rendezvous store",
    )
    parser.add_argument(
        "--rdzv-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="several nodes: the rendezvous store, at an address of node 0 every node reaches",
    )
    parser.add_argument(
        "--rdzv-id",
        default="ddpkit",
        metavar="ID",
        help="several nodes: the job's name in the rendezvous, the same on every node",
    )
    parser.add_argument(
        "--rdzv-conf",
        default="",
        metavar="KEY=VALUE,...",
        help="several nodes: torchrun's rendezvous timings in seconds, e.g. "
        "last_call_timeout=5,keep_alive_interval=2 (keys: " + ", ".join(RDZV_CONF_KEYS) + "; "
        "torch's defaults when unset; see docs/launching.md)",
    )
    for name, what in (("cert", "certificate"), ("key", "private key"), ("ca", "CA bundle")):
        parser.add_argument(
            f"--tls-{name}",
            default=None,
            metavar="PEM",
            help=f"gloo TLS: this node's {what} (all three --tls-* or none; refused where the "
            "torch build lacks gloo TLS, see ddpkit doctor)",
        )


def run(args: argparse.Namespace) -> int:
    spec = launch_spec(args)
    validate_spec(spec)  # a missing script, -n 0, ...: one line before anything imports torch
    if spec.fault_tolerance == "live":
        from ddpkit.launch.live import launch_live

        return launch_live(spec)
    from ddpkit.launch.launcher import launch

    return launch(spec)


def launch_spec(args: argparse.Namespace) -> LaunchSpec:
    """The :class:`LaunchSpec` of parsed ``ddpkit run`` flags (restarts: 0, or
    ``ELASTIC_MAX_RESTARTS`` for ``--nnodes MIN:MAX``, unless given).

    Raises:
        ConfigError: incomplete TLS flags; ``--nnodes`` not ``N`` or ``MIN:MAX``.
    """
    target = _without_separator(args.target)
    if args.module:  # MODULE and everything after it (argparse.REMAINDER)
        module, *module_args = args.module
        target = ["-m", module, *module_args, *target]  # argparse puts what follows -- in target
    tls = (args.tls_cert, args.tls_key, args.tls_ca)
    if any(tls) and not all(tls):
        raise ConfigError(
            "incomplete TLS settings: give all of --tls-cert, --tls-key and --tls-ca, or none."
        )
    min_nodes, nnodes = parse_nnodes(args.nnodes)
    max_restarts = args.max_restarts
    live = args.fault_tolerance == "live"
    if args.spares and not live:
        raise ConfigError(
            f"--spares {args.spares} without --fault-tolerance live: warm spares take over lost "
            "ranks of a live job only. Add --fault-tolerance live, or drop --spares."
        )
    if max_restarts is None:
        max_restarts = ELASTIC_MAX_RESTARTS if min_nodes < nnodes else 0
        max_restarts = LIVE_MAX_RESTARTS if live else max_restarts
    return LaunchSpec(
        target=target,
        nproc=args.nproc,
        max_restarts=max_restarts,
        omp_num_threads=args.omp_num_threads,
        nnodes=nnodes,
        min_nodes=min_nodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        rdzv_conf=args.rdzv_conf,
        tls=tls if all(tls) else None,
        resume_command=shlex.join(["ddpkit", *args.argv]),
        grace_period_s=args.grace_period,
        stop_signals=parse_stop_signals(args.stop_signals),
        fault_tolerance=args.fault_tolerance,
        spares=args.spares,
        heartbeat_timeout_s=args.heartbeat_timeout,
    )


def _without_separator(arguments: list[str]) -> list[str]:
    """The script's (or module's) arguments without a leading ``--``."""
    return list(arguments[1:] if arguments[:1] == ["--"] else arguments)


def parse_nnodes(value: str) -> tuple[int, int]:
    """``"3"`` -> ``(3, 3)``, ``"2:3"`` -> ``(2, 3)``: the fewest and the most nodes.

    Raises:
        ConfigError: not ``N`` or ``MIN:MAX`` with integers (the range is checked with the rest
            of the launch).
    """
    parts = value.split(":")
    if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
        raise ConfigError(
            f"invalid --nnodes: nnodes={value!r}. Give a number of nodes N or a range MIN:MAX "
            "(e.g. --nnodes 2 or --nnodes 2:4)."
        )
    return int(parts[0]), int(parts[-1])
