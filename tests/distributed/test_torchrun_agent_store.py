"""``init_runtime`` under plain torchrun with its shared agent store (torchrun's default).

torch's agent store lives as long as the agents and keeps every key across rendezvous rounds,
and a round restarted for a node waiting to join keeps ``TORCHELASTIC_RESTART_COUNT``. A round's
workers must not meet the previous round's keys (they claimed the same ranks). Here the test
process plays the agent (a TCPStore server on loopback, as torchrun's rank-0 agent hosts it) and
rounds of 2 ranks with the same restart count run against it, one after the other; in the later
rounds rank 0 starts 1 s late, so rank 1 reads an earlier round's entry first.
"""

from __future__ import annotations

import datetime
import logging
import os
import time

import torch.distributed as dist

import ddpkit
from ddpkit.runtime.rendezvous import PREFIX, ROUND_STORE_KEY, _round_address
from ddpkit.testing import run_distributed

EXPECTED = ["rank 0 sum 2.0", "rank 1 sum 2.0"]


def _one_round(_file_store, agent_port: int, rank0_delay_s: float) -> str:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(agent_port),
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RESTART_COUNT="0",
    )
    if os.environ["RANK"] == "0":
        time.sleep(rank0_delay_s)
    with ddpkit.init_runtime("gloo", init_timeout_s=20) as rt:
        return f"rank {rt.rank} sum {ddpkit.all_reduce_sum([1.0], rt).item()}"


def _store(port: int = 0) -> dist.TCPStore:
    timeout = datetime.timedelta(seconds=30)
    return dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timeout, use_libuv=True)


def _round(agent: dist.TCPStore, rank0_delay_s: float = 0.0) -> list[str]:
    args = (agent.port, rank0_delay_s)
    return run_distributed(_one_round, 2, args=args, init=False, timeout_s=60)


def test_a_second_round_with_the_same_restart_count_starts_clean():
    agent = _store()
    assert _round(agent) == EXPECTED
    # the first round's workers are gone; their claims and rank 0's entry (a dead port) stay
    assert _round(agent, rank0_delay_s=1.0) == EXPECTED
    assert not agent.check([f"{PREFIX}/count"])  # the claims live in each round's own store


def test_an_entry_whose_port_holds_another_store_is_not_taken():
    agent, decoy = _store(), _store()
    decoy.set("ddpkit/round_nonce", "0123456789abcdef")  # a live store, another round's nonce
    agent.set(ROUND_STORE_KEY, f"{decoy.port} 0123456789abcdef-")
    assert _round(agent, rank0_delay_s=1.0) == EXPECTED
    assert not decoy.check([f"{PREFIX}/count"])  # nobody joined the decoy


def test_where_rank_0_serves_a_round(caplog):
    assert _round_address("localhost", multi_node=False) == "127.0.0.1"
    # several nodes, and the node's name resolves to loopback here (Debian's 127.0.1.1):
    # the other nodes reach rank 0 through another address, so every interface, said once
    with caplog.at_level(logging.WARNING):
        assert _round_address("127.0.0.1", multi_node=True) == "0.0.0.0"
    assert "MASTER_ADDR=127.0.0.1 resolves to 127.0.0.1 on rank 0's node" in caplog.text
    assert "torchrun --local-addr ADDRESS avoids it" in caplog.text
