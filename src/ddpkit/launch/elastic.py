"""Elastic membership and restarts under ``ddpkit run``: the rendezvous settings, and what the
launcher says when torchrun's agent restarts the workers.

The membership itself is torchrun's (the c10d dynamic rendezvous of
``torch/distributed/elastic/rendezvous/dynamic_rendezvous.py``; the restart loop is the agent's
``_invoke_run`` in ``torch/distributed/elastic/agent/server/api.py``): with ``--nnodes MIN:MAX``
a round completes with MAX nodes at once, or with at least MIN once ``last_call_timeout`` (torch:
30 s) has passed since the MIN-th joined; a node whose agent stops heartbeating
(``keep_alive_interval`` x ``keep_alive_max_attempt``, torch: 5 s x 3) is dropped from the
rendezvous; a failed worker group is restarted (one of ``--max-restarts``); a node waiting to
join makes every agent restart its workers at the next monitor tick (free). ddpkit passes those
settings through (``--rdzv-conf``) and turns the agent's INFO records about restarts into one
line each.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

# annotations only: the launcher imports this module, and failures imports torch (ddpkit run's
# parser reads RDZV_CONF_KEYS here, and answers --help without torch)
if TYPE_CHECKING:
    from ddpkit.diagnostics.failures import FailureRecord
    from ddpkit.launch.launcher import LaunchSpec

# The dynamic rendezvous's timings a user may set (seconds; counts for keep_alive_max_attempt).
RDZV_CONF_KEYS = (
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "heartbeat_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
)
AGENT_LOGGER = "torch.distributed.elastic.agent.server.api"
# set for the workers of an elastic job (--nnodes MIN:MAX): a stop asked on another node is that
# node's leaving or its agent's membership restart, not the end of this node's job
ELASTIC_ENV = "DDPKIT_ELASTIC"


def parse_rdzv_conf(text: str) -> tuple[dict[str, int], list[str]]:
    """``"last_call_timeout=5,keep_alive_interval=1"`` -> the settings, and the problems found.

    Every key must be one of :data:`RDZV_CONF_KEYS` with a positive integer value; ``is_host``
    and ``read_timeout`` are ddpkit's own (its store, its bound on each store call).
    """
    conf: dict[str, int] = {}
    problems = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in RDZV_CONF_KEYS:
            problems.append(
                f"rdzv_conf key {key!r} is not one of {', '.join(RDZV_CONF_KEYS)} (ddpkit sets "
                "is_host and read_timeout itself)"
            )
        elif not value.strip().isdigit() or int(value) < 1:
            problems.append(f"rdzv_conf {key}={value.strip()!r} must be an integer >= 1")
        else:
            conf[key] = int(value)
    return conf, problems


def node_problems(spec: LaunchSpec) -> list[str]:
    """What is wrong with ``spec``'s node settings (nodes, node rank, rendezvous, TLS files)."""
    problems = []
    if spec.nnodes < 1:
        problems.append(f"nnodes={spec.nnodes} must be >= 1")
    elif spec.min_nodes is not None and not 1 <= spec.min_nodes <= spec.nnodes:
        problems.append(
            f"nnodes={spec.min_nodes}:{spec.nnodes} must be MIN:MAX with 1 <= MIN <= MAX"
        )
    elif not 0 <= spec.node_rank < spec.nnodes:
        problems.append(f"node_rank={spec.node_rank} must be in 0..{spec.nnodes - 1}")
    if spec.nnodes > 1 and not spec.rdzv_endpoint:
        problems.append("several nodes need --rdzv-endpoint HOST:PORT (an address of node 0)")
    if spec.rdzv_endpoint and spec.nnodes == 1:
        problems.append("--rdzv-endpoint is for several nodes (--nnodes N > 1)")
    if spec.rdzv_endpoint:
        host, _, port = spec.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            problems.append(f"rdzv_endpoint={spec.rdzv_endpoint!r} must be HOST:PORT")
    problems += parse_rdzv_conf(spec.rdzv_conf)[1]
    for path in spec.tls or ():
        if not os.path.isfile(path):
            problems.append(f"TLS file {path!r} does not exist")
    return problems


def rendezvous_error_line(
    spec: LaunchSpec,
    endpoint: str,
    exc: Exception,
    records: list[FailureRecord],
    *,
    joined_before: bool,
) -> str:
    """The one line for torchrun's agent giving up on the rendezvous (``RendezvousError``).

    A connection error once this node had joined a round (``joined_before``): the store was
    reachable, so node 0, which hosts it, is gone or cut off, and no node can go on without it
    (``records``: the workers' failures, the first named). A timeout: fewer than MIN nodes came
    within ``join_timeout``. Closed: the job already ended.
    """
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )

    first = str(exc).strip().splitlines()[0].rstrip(".") if str(exc).strip() else ""
    label = f"{spec.command}:"
    if isinstance(exc, RendezvousConnectionError) and joined_before:
        failed = f"the workers failed (first: {records[0].headline}) and " if records else ""
        return (
            f"{label} {failed}the rendezvous store at {endpoint} no longer answers: node 0, "
            "which hosts it, is gone or unreachable. An elastic job goes on after losing any "
            "node but node 0; start the job again (on node 0 first) and it resumes from the "
            "newest checkpoint."
        )
    if isinstance(exc, RendezvousTimeoutError):
        fewest = spec.min_nodes if spec.elastic else spec.nnodes
        return (
            f"{label} the rendezvous at {endpoint} timed out: fewer than {fewest} node(s) "
            "joined within its join_timeout (torch: 600 s; --rdzv-conf join_timeout=S). Start "
            "the missing nodes with the same --rdzv-endpoint and --rdzv-id, or lower MIN in "
            "--nnodes MIN:MAX."
        )
    if isinstance(exc, RendezvousClosedError):
        return (
            f"{label} the job at {endpoint} (--rdzv-id {spec.rdzv_id}) has already finished: "
            "its rendezvous is closed to new nodes. Start a new job with another --rdzv-id."
        )
    return (
        f"{label} cannot join the rendezvous at {endpoint}: {first or type(exc).__name__}. "
        "Check that node 0 runs ddpkit run with the same --rdzv-endpoint and --rdzv-id, and "
        "that this node can reach that address."
    )


class RestartAnnouncer(logging.Filter):
    """Turns the agent's INFO records about restarts and rendezvous into one launcher line each.

    Attached to torchrun's agent logger with its level lowered to INFO for the launch; the INFO
    records a user did not ask for (``LOGLEVEL``) are dropped after being read, so torchrun's
    own output is unchanged.
    """

    def __init__(self, command: str, *, elastic: bool, logger: logging.Logger) -> None:
        super().__init__()
        self.command, self.elastic = command, elastic
        self.show_info = logger.isEnabledFor(logging.INFO)  # LOGLEVEL=INFO: torchrun prints it
        self.saved_level = logger.level
        self.restarted = False
        self.rendezvous_done = 0  # rounds this node's agent completed

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO:
            return True
        line = self.line(str(record.msg), record.args)
        if line:
            print(f"{self.command}: {line}", file=sys.stderr, flush=True)
        return self.show_info

    def line(self, template: str, args: object) -> str:
        """The launcher's line for one agent record (``""``: nothing to say)."""
        if "attempts left" in template and isinstance(args, tuple) and len(args) == 4:
            _, state, left, most = args
            self.restarted = True
            where = " on the nodes that join the next rendezvous" if self.elastic else ""
            return f"workers {state}; restarting them{where} (restart {most - left + 1} of {most})."
        if "new nodes from" in template and isinstance(args, tuple) and len(args) == 3:
            self.restarted = True
            return (
                f"{args[1]} node(s) waiting to join; restarting the workers to take them in "
                "(not counted as a restart)."
            )
        if "Rendezvous complete" in template and isinstance(args, dict):
            self.rendezvous_done += 1
            if not (self.elastic or self.restarted):
                return ""
            ranks = args.get("global_ranks") or []
            sizes = args.get("global_world_sizes") or [0]
            return (
                f"rendezvous complete: {args.get('group_world_size')} node(s), world size "
                f"{sizes[0]}; this node runs rank(s) {', '.join(map(str, ranks))}."
            )
        return ""


def announce_restarts(command: str, *, elastic: bool) -> tuple[logging.Logger, RestartAnnouncer]:
    """Attach a :class:`RestartAnnouncer` to the agent logger; undo with :func:`quiet_restarts`."""
    logger = logging.getLogger(AGENT_LOGGER)
    announcer = RestartAnnouncer(command, elastic=elastic, logger=logger)
    logger.setLevel(min(logger.getEffectiveLevel(), logging.INFO))
    logger.addFilter(announcer)
    return logger, announcer


def quiet_restarts(logger: logging.Logger, announcer: RestartAnnouncer) -> None:
    logger.removeFilter(announcer)
    logger.setLevel(announcer.saved_level)
