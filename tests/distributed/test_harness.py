"""The test harness itself: the first failure kills every rank and carries its traceback back."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import ddpkit
from ddpkit.testing import DistributedTestError, run_distributed


def _rank_one_raises(runtime):
    if runtime.rank == 1:
        raise KeyError("missing-shard")
    ddpkit.all_reduce_sum([1.0], runtime)  # rank 0 waits here for a peer that never comes
    return "unreachable"


def _rank_one_hangs(runtime):
    if runtime.rank == 1:
        while True:
            time.sleep(0.05)
    return runtime.rank


def test_first_failure_kills_all_ranks_with_the_traceback():
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_rank_one_raises, 2, pg_timeout_s=60)
    assert time.monotonic() - start < 30  # far below the 60 s collective timeout
    message = str(info.value)
    assert "--- rank 1 raised:" in message and "KeyError: 'missing-shard'" in message
    assert "_rank_one_raises" in message  # the traceback names the failing function


@pytest.mark.slow
def test_harness_timeout_names_the_ranks_still_running():
    with pytest.raises(
        DistributedTestError, match=r"timed out after 12 s; ranks still running: \[1\]"
    ):  # rank 0 starts, joins and returns in ~5 s on a loaded 2-core machine
        run_distributed(_rank_one_hangs, 2, timeout_s=12)


def _rank_one_starts_a_child_and_waits(runtime, pid_file: str):
    """Rank 1 starts a process of its own (as a DataLoader worker would) and hangs; rank 0
    fails once that process runs."""
    import subprocess
    from pathlib import Path

    if runtime.rank == 1:
        child = subprocess.Popen(["sleep", "600"])
        Path(pid_file).write_text(str(child.pid))
        while True:
            time.sleep(0.05)
    while not Path(pid_file).exists():
        time.sleep(0.01)
    raise KeyError("missing-shard")


def test_a_killed_ranks_own_processes_die_with_it(tmp_path):
    # a DataLoader worker stuck in a fork deadlock (CPython gh-112275, Python <= 3.11.9) outlived
    # its rank, which the harness had killed, and stayed for good: the harness now kills what
    # is below a rank too
    from tests.helpers import pid_alive

    pid_file = tmp_path / "child.pid"
    with pytest.raises(DistributedTestError, match="KeyError: 'missing-shard'"):
        run_distributed(_rank_one_starts_a_child_and_waits, 2, args=(str(pid_file),))
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while pid_alive(child) and time.monotonic() < deadline:  # SIGKILL is not instant
        time.sleep(0.05)
    alive = pid_alive(child)
    if alive:
        os.kill(child, signal.SIGKILL)
    assert not alive, "the rank's child outlived the run"


def _process_group_id(runtime) -> int:
    return os.getpgrp()


def test_ranks_stay_in_the_callers_process_group():
    # so that killing the caller's group (a timeout's killpg, a CI cancel) ends the ranks too
    assert run_distributed(_process_group_id, 2) == [os.getpgrp()] * 2


def _backend_and_device(runtime):
    return runtime.backend, str(runtime.device), ddpkit.all_reduce_sum([1.0], runtime).item()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine could run nccl")
def test_backend_auto_is_gloo_on_cpu_and_nccl_without_gpus_fails_in_the_rank():
    assert run_distributed(_backend_and_device, 2, backend="auto") == [("gloo", "cpu", 2.0)] * 2
    with pytest.raises(DistributedTestError, match="backend=nccl needs one CUDA device"):
        run_distributed(_backend_and_device, 2, backend="nccl")
