"""The pieces of elastic launching that need no nodes: rendezvous settings, the lines said when
the rendezvous fails, and the agent-log filter that announces restarts."""

from __future__ import annotations

import inspect
import logging

import pytest
from torch.distributed.elastic.agent.server import api as agent_api
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousTimeoutError,
)

from ddpkit.diagnostics.failures import FailureRecord
from ddpkit.launch.elastic import (
    AGENT_LOGGER,
    announce_restarts,
    parse_rdzv_conf,
    quiet_restarts,
    rendezvous_error_line,
)
from ddpkit.launch.launcher import LaunchSpec

ELASTIC = LaunchSpec(["x.py"], 1, nnodes=3, min_nodes=2, rdzv_endpoint="10.0.0.1:29400")


def test_rdzv_conf_takes_torchs_timings_and_refuses_the_rest():
    conf, problems = parse_rdzv_conf("last_call_timeout=5, keep_alive_interval=1")
    assert conf == {"last_call_timeout": 5, "keep_alive_interval": 1} and problems == []
    conf, problems = parse_rdzv_conf("is_host=1,join_timeout=0,keep_alive_max_attempt=x")
    assert conf == {}
    assert "rdzv_conf key 'is_host' is not one of" in problems[0]
    assert problems[1:] == [
        "rdzv_conf join_timeout='0' must be an integer >= 1",
        "rdzv_conf keep_alive_max_attempt='x' must be an integer >= 1",
    ]
    assert parse_rdzv_conf("") == ({}, [])


def _record() -> FailureRecord:
    return FailureRecord(0, 0, 3, 0, "DistributedError", "all_reduce failed", "", 1.0, 42)


LOST = RendezvousConnectionError("The connection to the C10d store has failed.")


@pytest.mark.parametrize(
    "exc,records,joined,expected",
    [
        (
            LOST,
            [_record()],
            True,
            "the workers failed (first: rank 0/3 (local rank 0, pid 42): DistributedError: "
            "all_reduce failed) and the rendezvous store at 10.0.0.1:29400 no longer answers: "
            "node 0, which hosts it, is gone or unreachable.",
        ),
        (LOST, [], True, "ddpkit run: the rendezvous store at 10.0.0.1:29400 no longer answers"),
        (
            LOST,
            [],
            False,
            "cannot join the rendezvous at 10.0.0.1:29400: The connection to the C10d store "
            "has failed. Check that node 0 runs ddpkit run",
        ),
        (RendezvousTimeoutError(), [], True, "timed out: fewer than 2 node(s) joined"),
        (RendezvousClosedError(), [], False, "(--rdzv-id ddpkit) has already finished"),
    ],
)
def test_rendezvous_errors_are_one_line_naming_the_cause(exc, records, joined, expected):
    line = rendezvous_error_line(ELASTIC, "10.0.0.1:29400", exc, records, joined_before=joined)
    assert line.startswith("ddpkit run: ") and expected in line and "\n" not in line
    assert ".." not in line


def test_restart_lines_come_from_the_agents_info_records_which_stay_hidden(capsys):
    # the templates ddpkit reads are torch's own (a torch upgrade that rewords them fails here)
    for text in ("attempts left", "new nodes from", "Rendezvous complete"):
        assert text in inspect.getsource(agent_api.SimpleElasticAgent)
    logger = logging.getLogger(AGENT_LOGGER)
    level = logger.level
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append
    logger.addHandler(handler)
    try:
        attached = announce_restarts("ddpkit run", elastic=True)
        logger.info(
            "[%s] Worker group %s. %s/%s attempts left; will restart worker group",
            "default",
            "FAILED",
            3,
            3,
        )
        logger.info(
            "[%s] Detected %s new nodes from group_rank=%s; will restart worker group",
            "default",
            1,
            0,
        )
        logger.info(
            "[%(role)s] Rendezvous complete for workers. Result:\n  group_world_size=",
            {
                "role": "default",
                "group_world_size": 2,
                "global_ranks": [1],
                "global_world_sizes": [2],
            },
        )
        logger.warning("a warning")
        quiet_restarts(*attached)
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in seen] == ["a warning"]  # INFO records: read, not shown
    assert logger.level == level
    assert capsys.readouterr().err.splitlines() == [
        "ddpkit run: workers FAILED; restarting them on the nodes that join the next rendezvous "
        "(restart 1 of 3).",
        "ddpkit run: 1 node(s) waiting to join; restarting the workers to take them in (not "
        "counted as a restart).",
        "ddpkit run: rendezvous complete: 2 node(s), world size 2; this node runs rank(s) 1.",
    ]
