"""One string-hash seed per job: ``ddpkit run`` gives every rank the same ``PYTHONHASHSEED``,
and ``init_runtime`` warns once under plain torchrun, where each rank has its own.

Four launches in all, ~5 s of CPU each on two cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import run_cli

HASHES = str(Path(__file__).parent / "scripts" / "hashes.py")
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
WARNING = "string hashes differ across ranks"


def _reports(stdout: str) -> list[dict]:
    """Each rank's report from hashes.py, by rank."""
    found = [json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("HASHES ")]
    return sorted(found, key=lambda report: report["rank"])


def _hash_under_seed(seed: str) -> int:
    """``hash("abc")`` in a fresh interpreter started with ``PYTHONHASHSEED=seed``."""
    out = subprocess.run(
        [sys.executable, "-c", "print(hash('abc'))"],
        env={"PYTHONHASHSEED": seed},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return int(out.stdout)


@pytest.mark.slow
def test_ddpkit_run_gives_every_rank_one_seed_and_keeps_the_users(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    result = run_cli(["-m", "ddpkit", "run", "-n", "2", HASHES])
    assert result.returncode == 0, result.output
    first, second = _reports(result.stdout)
    assert first["seed"] == second["seed"] and 1 <= int(first["seed"]) <= 2**32 - 1
    assert first["hash"] == second["hash"] == _hash_under_seed(first["seed"])
    assert first["ids"] == second["ids"] and first["agree"] is second["agree"] is True
    assert WARNING not in result.stderr

    user = run_cli(["-m", "ddpkit", "run", "-n", "2", HASHES], env={"PYTHONHASHSEED": "123"})
    assert user.returncode == 0, user.output
    assert [r["seed"] for r in _reports(user.stdout)] == ["123", "123"]  # passed through
    assert [r["hash"] for r in _reports(user.stdout)] == [_hash_under_seed("123")] * 2
    assert WARNING not in user.stderr


@pytest.mark.slow
def test_plain_torchrun_gives_each_rank_its_own_class_ids_and_ddpkit_warns_once(monkeypatch):
    # the bug itself, under plain torch: list(set(labels)) orders the classes per process
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    result = run_cli([*TORCHRUN, HASHES])
    assert result.returncode == 0, result.output
    first, second = _reports(result.stdout)
    assert first["seed"] is second["seed"] is None
    assert first["hash"] != second["hash"]
    assert first["ids"] != second["ids"]  # same labels, other ids: equal by chance ~1 in 10^6
    assert first["agree"] is second["agree"] is False
    assert result.stderr.count(WARNING) == 1, result.stderr  # rank 0 only
    (line,) = [line for line in result.stderr.splitlines() if WARNING in line]
    assert "PYTHONHASHSEED=unset on rank 0" in line
    assert "class ids from list(set(labels))" in line
    assert "Launch with `ddpkit run`" in line and "export PYTHONHASHSEED=0" in line

    fixed = run_cli([*TORCHRUN, HASHES], env={"PYTHONHASHSEED": "0"})
    assert fixed.returncode == 0, fixed.output
    first, second = _reports(fixed.stdout)
    assert first["ids"] == second["ids"] and first["hash"] == second["hash"]
    assert first["agree"] is second["agree"] is True
    assert WARNING not in fixed.stderr
