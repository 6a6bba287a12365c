"""The job's string-hash seed: derived from the rendezvous run id, in Python's range, the same
on every node of a job, and never put over a ``PYTHONHASHSEED`` the user set."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpkit.launch.launcher import LaunchSpec, _run_id, _worker_environment
from ddpkit.launch.network import plan_network
from ddpkit.runtime.hashseed import (
    HASH_SEED_ENV,
    hash_seed_environment,
    job_hash_seed,
    str_hashes_warning,
)

PROBE = str(Path(__file__).resolve().parents[1] / "cli" / "scripts" / "probe.py")


def test_the_seed_is_a_stable_32_bit_value_never_0():
    assert job_hash_seed("ddpkit") == 4085168302  # pinned: every node and version agrees
    seeds = {job_hash_seed(f"job-{index}") for index in range(2000)}
    assert len(seeds) == 2000 and all(1 <= seed <= 2**32 - 1 for seed in seeds)


@pytest.mark.parametrize("value", ["123", "0", "random"])
def test_a_seed_the_user_set_is_passed_through_unchanged(value):
    assert hash_seed_environment("job", {HASH_SEED_ENV: value}) == {}


@pytest.mark.parametrize("environ", [{}, {HASH_SEED_ENV: ""}])  # empty: Python's "unset"
def test_without_a_user_seed_the_job_gets_its_own(environ):
    assert hash_seed_environment("job", environ) == {HASH_SEED_ENV: str(job_hash_seed("job"))}


def test_every_node_of_a_job_derives_the_same_seed_without_talking(monkeypatch, tmp_path):
    monkeypatch.delenv(HASH_SEED_ENV, raising=False)
    node = dict(target=[PROBE], nproc=2, nnodes=2, rdzv_endpoint="127.0.0.1:29400", rdzv_id="j7")
    seeds = set()
    for node_rank in (0, 1):
        spec = LaunchSpec(**node, node_rank=node_rank)
        env = _worker_environment(spec, plan_network(spec), str(tmp_path))
        seeds.add(env[HASH_SEED_ENV])
    assert seeds == {str(job_hash_seed("j7"))}
    # one node: a new rendezvous run id per job, but the seed comes from --rdzv-id, so a job
    # submitted again (resuming its checkpoint) orders its strings as before
    one = LaunchSpec(target=[PROBE], nproc=2)
    assert _run_id(one) != _run_id(one)
    first, again = (_worker_environment(one, plan_network(one), str(tmp_path)) for _ in range(2))
    assert first[HASH_SEED_ENV] == again[HASH_SEED_ENV] == str(job_hash_seed("ddpkit"))


def test_a_user_seed_reaches_the_workers_untouched(monkeypatch, tmp_path):
    monkeypatch.setenv(HASH_SEED_ENV, "123")
    spec = LaunchSpec(target=[PROBE], nproc=2)
    env = _worker_environment(spec, plan_network(spec), str(tmp_path))
    assert HASH_SEED_ENV not in env  # the launcher's own environment, 123, is what torchrun copies


def test_the_warning_names_the_cause_the_victims_and_the_fix():
    text = str_hashes_warning(None)
    assert text.startswith(
        "string hashes differ across ranks: PYTHONHASHSEED=unset on rank 0 (unset, 'random' or "
        "different on the other ranks)."
    ), text
    assert "class ids from list(set(labels)), vocabularies" in text and "silently" in text
    assert text.endswith(
        "Launch with `ddpkit run` (which gives every rank one seed), or `export "
        "PYTHONHASHSEED=0` (any fixed value) before torchrun/srun."
    ), text
    random = str_hashes_warning("random")  # ddpkit run passes 'random' through: not its fix
    assert "PYTHONHASHSEED='random' gives every process its own salt" in random
    assert "unset it under `ddpkit run`" in random
