"""``init_runtime`` compares ``hash("ddpkit-hash-probe")`` across ranks in its rendezvous: the
verdict on every rank (``runtime.str_hashes_agree``), one warning on rank 0 when they differ."""

from __future__ import annotations

import logging
import os

import pytest

import ddpkit
from ddpkit.testing import run_distributed


def _verdict(runtime):
    return runtime.str_hashes_agree, os.environ.get("PYTHONHASHSEED"), hash("abc")


def test_forked_ranks_share_the_forkservers_hash_and_agree():
    # a fork keeps its parent's hash secret: the ranks agree, whatever PYTHONHASHSEED says
    (agree0, _, hash0), (agree1, _, hash1) = run_distributed(_verdict, 2)
    assert agree0 is agree1 is True and hash0 == hash1


@pytest.mark.slow
def test_spawned_ranks_get_one_seed_from_the_harness(monkeypatch):
    # spawn: virgin interpreters, which would each draw a random hash secret without one seed
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    results = run_distributed(_verdict, 2, start_method="spawn")
    (agree0, seed0, hash0), (agree1, seed1, hash1) = results
    assert agree0 is agree1 is True and seed0 == seed1 and 1 <= int(seed0) <= 2**32 - 1
    assert hash0 == hash1
    assert "PYTHONHASHSEED" not in os.environ  # the parent's environment is back as it was


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _join_with_probe(store, probes):
    """Rank r's probe is ``probes[r]`` (a forked rank cannot change its real hash secret)."""
    import ddpkit.runtime.rendezvous as rendezvous

    rank = int(os.environ["RANK"])
    rendezvous.str_hash_probe = lambda: probes[rank]  # this rank's process only
    records = _Records()
    logging.getLogger("ddpkit").addHandler(records)
    with ddpkit.init_runtime("gloo", store=store, init_timeout_s=30, train_timeout_s=30) as rt:
        return rt.str_hashes_agree, records.messages


def test_one_rank_with_another_hash_is_seen_by_all_and_said_once_on_rank_0():
    results = run_distributed(_join_with_probe, 3, args=([5, 5, 6],), init=False)
    assert [agree for agree, _ in results] == [False, False, False]
    assert [len(messages) for _, messages in results] == [1, 0, 0]
    assert results[0][1][0].startswith("string hashes differ across ranks: PYTHONHASHSEED=")
    assert run_distributed(_join_with_probe, 3, args=([5, 5, 5],), init=False) == [(True, [])] * 3
