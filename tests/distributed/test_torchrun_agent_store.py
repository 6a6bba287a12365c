"""``init_runtime`` under plain torchrun with its shared agent store (torchrun's default).

torch's agent store lives as long as the agents and keeps every key across rendezvous rounds,
and a round restarted for a node waiting to join keeps ``TORCHELASTIC_RESTART_COUNT``. A round's
workers must not meet the previous round's keys (they claimed the same ranks). Here the test
process plays the agent (a TCPStore server on loopback, as torchrun's rank-0 agent hosts it) and
two rounds of 2 ranks with the same restart count run against it, one after the other.
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

import ddpkit
from ddpkit.testing import run_distributed


def _one_round(_file_store, agent_port: int) -> str:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(agent_port),
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RESTART_COUNT="0",
    )
    with ddpkit.init_runtime("gloo", init_timeout_s=20) as rt:
        return f"rank {rt.rank} sum {ddpkit.all_reduce_sum([1.0], rt).item()}"


def test_a_second_round_with_the_same_restart_count_starts_clean():
    agent = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=30), use_libuv=True
    )
    expected = ["rank 0 sum 2.0", "rank 1 sum 2.0"]
    first = run_distributed(_one_round, 2, args=(agent.port,), init=False, timeout_s=60)
    assert first == expected
    # the first round's workers are gone; their keys (and rank 0's store address) stay
    second = run_distributed(_one_round, 2, args=(agent.port,), init=False, timeout_s=60)
    assert second == expected
