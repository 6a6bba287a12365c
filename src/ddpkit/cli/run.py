"""``ddpkit run -n N [--] script.py [args...]``: start N ranks on this node through torchrun."""

from __future__ import annotations

import argparse
import dataclasses
import shlex

from ddpkit.cli.flags import add_settings_arguments, given_settings
from ddpkit.errors import ConfigError
from ddpkit.launch.config import ELASTIC_MAX_RESTARTS, LaunchConfig, default_max_restarts
from ddpkit.launch.elastic import RDZV_CONF_KEYS
from ddpkit.launch.spec import LaunchSpec, spec_of, validate_spec

LAUNCH = {"launch": LaunchConfig}  # the launch flags, declared once with ddpkit train's

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
    add_settings_arguments(
        parser,
        LAUNCH,
        config_file=False,
        short={"nproc": "-n"},
        required=("nproc",),
        notes={"max_restarts": f"; --nnodes MIN:MAX: {ELASTIC_MAX_RESTARTS}, one per node lost"},
    )
    parser.add_argument(
        "--omp-num-threads",
        type=int,
        default=None,
        metavar="T",
        help="threads per process (default: OMP_NUM_THREADS if set, else usable cores // N)",
    )
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
    """The :class:`LaunchSpec` of parsed ``ddpkit run`` flags (restarts, unless given:
    :func:`~ddpkit.launch.config.default_max_restarts`). Not yet checked (see
    :func:`~ddpkit.launch.spec.validate_spec`).

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
    given = given_settings(args, LAUNCH)
    settings = LaunchConfig(**given)
    if "max_restarts" not in given:
        elastic = min_nodes < nnodes
        restarts = default_max_restarts(settings.fault_tolerance, elastic=elastic)
        settings = dataclasses.replace(settings, max_restarts=restarts)
    return spec_of(
        settings,
        target,
        omp_num_threads=args.omp_num_threads,
        nnodes=nnodes,
        min_nodes=min_nodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        rdzv_conf=args.rdzv_conf,
        tls=tls if all(tls) else None,
        resume_command=shlex.join(["ddpkit", *args.argv]),
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
