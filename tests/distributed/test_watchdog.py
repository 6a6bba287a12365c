"""Rendezvous names missing or duplicate ranks; the watchdog names a stuck rank, shows its stack."""

from __future__ import annotations

import os
import re
import sys
import textwrap
import time

import pytest

import ddpkit
from ddpkit.distributed.env import ProcessInfo
from ddpkit.testing import run_distributed
from tests.helpers import run_cli


def _join_as(store, rank: int | None, world_size: int) -> str:
    """Call init_runtime claiming ``rank`` (None: the harness's own) of ``world_size``."""
    own = int(os.environ["RANK"])
    info = ProcessInfo(
        rank=own if rank is None else rank,
        local_rank=own,
        world_size=world_size,
        local_world_size=world_size,
        source="torchrun",
    )
    start = time.monotonic()
    try:
        with ddpkit.init_runtime("gloo", init_timeout_s=3, info=info, store=store):
            return "joined"
    except ddpkit.DistributedError as exc:
        return f"{time.monotonic() - start:.1f}|{exc}"


def test_missing_ranks_are_named_within_the_init_timeout():
    results = run_distributed(_join_as, world_size=2, args=(None, 4), init=False, timeout_s=60)
    for result in results:
        waited_s, message = result.split("|", 1)
        assert "rendezvous timed out after 3 s: 2 of 4 ranks joined (missing 2, 3)" in message
        assert 3.0 <= float(waited_s) < 10.0  # the init timeout, not the harness's 60 s


def test_two_processes_claiming_rank_zero_are_told_so():
    results = run_distributed(_join_as, world_size=2, args=(0, 2), init=False, timeout_s=60)
    for result in results:
        waited_s, message = result.split("|", 1)
        assert "rank 0 is claimed by two processes" in message
        assert message.count(" pid ") == 2  # both owners named
        assert float(waited_s) < 3.0  # told at once, not after the init timeout


STUCK_SCRIPT = """
import ddpkit

def spin_forever():
    while True:
        pass

with ddpkit.init_runtime("gloo", train_timeout_s=600, stall_timeout_s=2) as rt:
    ddpkit.all_reduce_sum([1.0], rt)
    if rt.rank == 1:
        spin_forever()
    ddpkit.all_reduce_sum([1.0], rt)
print("unreachable")
"""


NESTED_SCRIPT = """
import torch, torch.distributed as dist
import ddpkit

def spin_forever():
    while True:
        pass

with ddpkit.init_runtime("gloo", train_timeout_s=600, stall_timeout_s=2) as rt:
    with rt.watch("train step"):  # a user's block around ddpkit's own (nested) collective
        ddpkit.all_reduce_sum([1.0], rt)
        if rt.rank == 1:
            spin_forever()
        dist.all_reduce(torch.ones(1), group=rt.process_group)  # raw: watched by the block
"""


@pytest.mark.slow
def test_nested_watch_keeps_the_outer_block_watched(tmp_path):
    script = tmp_path / "nested.py"
    script.write_text(textwrap.dedent(NESTED_SCRIPT))
    result = run_cli(["-m", "ddpkit", "run", "-n", "2", str(script)], timeout_s=120)
    assert result.returncode == 1, result.output
    # both ranks are inside the block: the report (from whichever rank made it) shows the stacks
    assert re.search(r"stall: rank \d waited \d+ s in train step", result.output), result.output
    assert "in spin_forever" in result.output.split("stack of rank 1's training thread:")[1]


@pytest.mark.slow
def test_stuck_rank_is_named_with_its_stack(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(textwrap.dedent(STUCK_SCRIPT))
    start = time.monotonic()
    result = run_cli(["-m", "ddpkit", "run", "-n", "2", str(script)], timeout_s=120)
    elapsed_s = time.monotonic() - start
    out = result.output
    assert result.returncode == 1, out
    headline = r"stall: rank 0 waited \d+ s in all_reduce \(collective #2\); late rank\(s\): 1\n"
    assert re.search(headline, out), out
    assert "rank 1: has not arrived: after collective #1 (all_reduce)" in out
    stack_of_1 = out.split("stack of rank 1's training thread:")[1]
    assert "in spin_forever" in stack_of_1.split("stack of rank")[0]
    assert "in all_reduce" in out.split("stack of rank 0's training thread:")[1]
    assert "unreachable" not in out
    assert "StallError" in out  # the launcher's summary leads with the report
    assert elapsed_s < 100  # far below the 600 s collective timeout


def test_watchdog_costs_nothing_when_off():
    info = ProcessInfo()
    with ddpkit.init_runtime("gloo", info=info) as rt:
        assert rt.watchdog is None
        with rt.watch("all_reduce"):
            pass


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), 1.5])  # 1.5: under two heartbeats
def test_bad_stall_timeout_is_refused(bad):
    with pytest.raises(ddpkit.ConfigError, match="stall_timeout_s"):
        ddpkit.init_runtime("gloo", info=ProcessInfo(), stall_timeout_s=bad)


if sys.platform != "linux":  # pragma: no cover
    pytest.skip("Linux only", allow_module_level=True)
