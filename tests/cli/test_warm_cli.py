"""``tests.helpers.run_cli`` runs ``python -m ddpkit ...`` warm (forked from the harness's
forkserver): the command must give what a fresh interpreter gives, status and output."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

from tests.helpers import run_cli

SCRIPT = """
import os, sys
import ddpkit

with ddpkit.init_runtime() as rt:
    probe = os.environ.get("DDPKIT_WARM_PROBE")
    print(f"rank {rt.rank} of {rt.world_size} in {os.getcwd()} argv={sys.argv[1:]} {probe=}")
    if rt.rank == 1 and sys.argv[1] == "fail":
        sys.exit(3)
"""


def _both(args: list[str], **kwargs) -> tuple:
    warm = run_cli(["-m", "ddpkit", *args], **kwargs)
    cold = run_cli(["-m", "ddpkit", *args], program=[sys.executable], **kwargs)
    return warm, cold


def test_a_refused_flag_is_the_same_line_and_status(tmp_path):
    warm, cold = _both(["train", "--nprocs", "2"], cwd=str(tmp_path))
    assert warm.returncode == cold.returncode == 2
    assert warm.stderr == cold.stderr and "--nprocs" in warm.stderr
    assert warm.stdout == cold.stdout == ""


@pytest.mark.slow  # four 2-rank jobs
def test_a_job_gets_the_same_ranks_folder_environment_and_exit_status(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {"DDPKIT_WARM_PROBE": "1"}
    for verdict, status in (("pass", 0), ("fail", 3)):
        warm, cold = _both(["run", "-n", "2", "job.py", verdict], cwd=str(tmp_path), env=env)
        for done in (warm, cold):
            assert done.returncode == (0 if status == 0 else 1), done.output
            for rank in (0, 1):
                line = f"rank {rank} of 2 in {tmp_path} argv=['{verdict}'] probe='1'"
                assert line in done.stdout, done.output
        assert sorted(warm.stdout.splitlines()) == sorted(cold.stdout.splitlines())
        if status:
            for done in (warm, cold):
                assert "rank 1" in done.stderr and "exit" in done.stderr.lower(), done.stderr
    assert os.environ.get("DDPKIT_WARM_PROBE") is None  # the test's own environment untouched


def test_a_pythonpath_or_hash_seed_runs_cold():
    from tests.helpers import _warm_env_ok

    assert _warm_env_ok({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    assert not _warm_env_ok({"PYTHONPATH": "/x"})
    assert not _warm_env_ok({"PYTHONHASHSEED": "0"})
