"""The watchdog's verdict from every rank's position: a deadlock only when no collective can
finish; never for ranks in the same collective, a rank running code, or point-to-point calls."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch

from ddpkit.watchdog.position import (
    BACKWARD,
    COLLECTIVE,
    DATALOADER_WAIT,
    RUNNING,
    WAITING,
    Position,
    locate,
)
from ddpkit.watchdog.stall_report import describe, find_deadlock


def _in(op: str, group: str = "0", ranks=(0, 1), seq: int | None = 3, site: str = "t.py:1"):
    return Position(COLLECTIVE, op, group, tuple(ranks), seq, site)


BACKWARD_POS = Position(BACKWARD, "backward", site="t.py:7")


@pytest.mark.parametrize(
    "positions,deadlock",
    [
        # the same collective, from different source lines: one collective, it will finish
        ({0: _in("barrier", site="a.py:1"), 1: _in("barrier", site="b.py:9")}, False),
        ({0: _in("all_reduce"), 1: _in("barrier")}, True),  # different operation
        ({0: _in("all_reduce", group="0"), 1: _in("all_reduce", group="1")}, True),  # group
        ({0: _in("all_reduce", seq=3), 1: _in("all_reduce", seq=4)}, True),  # count
        ({0: _in("all_reduce"), 1: BACKWARD_POS}, True),  # user's all_reduce vs DDP's
        ({0: BACKWARD_POS, 1: BACKWARD_POS}, False),
        ({0: _in("all_reduce"), 1: Position(RUNNING, "download", site="t.py:3")}, False),
        ({0: _in("all_reduce"), 1: Position(WAITING, "recv", site="t.py:3")}, False),  # p2p
        ({0: _in("all_reduce")}, False),  # a rank not heard from: no verdict
        # world 3: ranks 0 and 1 complete a subgroup collective; rank 2 waits for them after
        (
            {
                0: _in("all_reduce", "2", (0, 1)),
                1: _in("all_reduce", "2", (0, 1)),
                2: _in("barrier", "0", (0, 1, 2)),
            },
            False,
        ),
        (
            {
                0: _in("all_reduce", "2", (0, 1)),
                1: _in("barrier", "0", (0, 1, 2)),
                2: _in("barrier", "0", (0, 1, 2)),
            },
            True,
        ),
    ],
)
def test_deadlock_only_when_no_collective_can_finish(positions, deadlock):
    world_size = 3 if 2 in positions or any(len(p.ranks) == 3 for p in positions.values()) else 2
    assert find_deadlock(positions, world_size) is deadlock


def test_describe_names_group_number_tensor_and_line():
    position = Position(COLLECTIVE, "all_reduce", "0", (0, 1), 3, "t.py:9", "evaluate", "f32 (4,)")
    assert describe(position, {"0": "the default group"}) == (
        "all_reduce on the default group (ranks 0, 1), its collective #3, f32 (4,), in ddpkit's "
        "evaluate(), called at t.py:9"
    )


def test_a_thread_running_user_code_is_located_at_its_line():
    ready, release = threading.Event(), threading.Event()

    def user_code():
        ready.set()
        release.wait()  # WAITING HERE

    thread = threading.Thread(target=user_code)
    thread.start()
    ready.wait()
    try:
        position = locate(sys._current_frames()[thread.ident], idle=True)
    finally:
        release.set()
        thread.join()
    assert position.state == RUNNING and not position.blocked
    assert position.op == "wait"  # the function running, in the standard library ...
    line = user_code.__code__.co_firstlineno + 2
    assert position.site == f"tests/unit/test_watchdog_verdicts.py:{line}"  # ... called from here


def test_a_rank_gathering_stacks_never_hides_a_peers_abort():
    # two ranks found one deadlock at about the same time: rank 1 reported and asked the others
    # to end; rank 0, a moment later, asked for stacks too. Its "dump" replaced the abort, so it
    # never ended, and the reporter's exit made its collective fail: an echo of the report.
    import torch.distributed as dist

    from ddpkit.env import ProcessInfo
    from ddpkit.watchdog.monitor import PREFIX, Watchdog

    store = dist.HashStore()
    ranks = [Watchdog(store, ProcessInfo(rank=r, world_size=2)) for r in (0, 1)]
    shared = dist.PrefixStore(PREFIX, store)
    shared.set("stack/1", "rank 1's stack")
    shared.set("request", "abort\ndeadlock: ...")  # what rank 1's _report_and_exit sets
    stacks = ranks[0]._gather_stacks()
    assert sorted(stacks) == [0, 1]
    assert shared.get("request") == b"abort\ndeadlock: ..."  # rank 0's next tick ends it
    alone = dist.HashStore()
    Watchdog(alone, ProcessInfo(rank=0, world_size=1))._gather_stacks()  # no request up yet
    assert dist.PrefixStore(PREFIX, alone).get("request") == b"dump"


def test_a_stall_with_the_peer_blocked_in_ddps_forward_says_the_collectives_differ():
    # rank 0's logging all_reduce inside `if rank == 0:` at step 0; rank 1 went on to step 1,
    # where DDP's forward rebuilds its buckets (a broadcast in C++): no c10d frame to match
    from ddpkit.watchdog.stall_report import STALL_ADVICE, stall_report

    ddp_forward = Position(WAITING, "_pre_forward", site="train.py:30")
    report = stall_report(
        0, 2, _in("all_reduce", site="train.py:25"), 15.0, {1: (ddp_forward, None)}
    )
    assert report.late_ranks == [1]
    assert report.advice != STALL_ADVICE and "main_process_first" not in report.advice
    assert report.advice.startswith(
        "Rank(s) 1 wait in other torch.distributed code, not in this collective: the ranks are "
        "most likely in different collectives"
    ), report.advice
    assert "if rank == 0:" in report.advice
    busy = stall_report(0, 2, _in("all_reduce"), 15.0, {1: (Position(RUNNING, "f"), None)})
    assert busy.advice == STALL_ADVICE  # a rank running code: rank 0 work may be legitimate


class _Blocking(torch.utils.data.Dataset):
    """Its one item blocks until ``release`` exists: a worker that never delivers a batch."""

    def __init__(self, release: str) -> None:
        self.release = release

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> int:
        while not os.path.exists(self.release):
            time.sleep(0.01)
        return index


def test_a_thread_waiting_for_its_dataloaders_workers_is_located_there(tmp_path):
    # a rank whose DataLoader worker is slow or stuck (one that hung in os.fork(), CPython
    # gh-112275) waits in torch's _try_get_data, deep in multiprocessing and selectors
    release = tmp_path / "release"
    loader = torch.utils.data.DataLoader(
        _Blocking(str(release)), num_workers=1, multiprocessing_context="fork"
    )
    started = threading.Event()

    def user_loop():
        started.set()
        for _ in loader:  # THE LOOP
            pass

    thread = threading.Thread(target=user_loop)
    thread.start()
    started.wait()
    try:
        deadline = time.monotonic() + 60
        while True:  # until the thread waits for the worker (its start takes a moment)
            position = locate(sys._current_frames()[thread.ident], idle=True)
            if position.op == DATALOADER_WAIT or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        release.touch()
        thread.join(timeout=60)
    assert position.state == RUNNING and not position.blocked  # no collective: never a deadlock
    assert position.op == DATALOADER_WAIT, position
    line = user_loop.__code__.co_firstlineno + 2
    assert position.site == f"tests/unit/test_watchdog_verdicts.py:{line}"
    assert describe(position) == (
        f"waiting for a batch from its DataLoader's worker processes, at {position.site}"
    )


def test_a_stall_behind_a_rank_waiting_for_its_dataloader_says_so():
    from ddpkit.watchdog.stall_report import STALL_ADVICE, stall_report

    waiting = Position(RUNNING, DATALOADER_WAIT, site="train.py:40")
    report = stall_report(0, 2, _in("all_reduce", site="train.py:25"), 300.0, {1: (waiting, None)})
    assert report.late_ranks == [1]
    assert report.ranks[1] == (
        "rank 1: busy, waiting for a batch from its DataLoader's worker processes, at train.py:40"
    )
    assert report.advice.startswith(
        "Rank(s) 1 wait for their DataLoader's worker processes: a worker is slow, or stuck"
    ), report.advice
    assert "py-spy dump --pid" in report.advice and "ddpkit doctor" in report.advice
    assert STALL_ADVICE not in report.advice  # not work the others legitimately wait for


def test_a_timeout_names_the_ranks_stuck_outside_a_collective_at_most_three():
    import torch.distributed as dist

    from ddpkit.env import ProcessInfo
    from ddpkit.watchdog.monitor import Watchdog

    watchdog = Watchdog(dist.HashStore(), ProcessInfo(rank=0, world_size=7))
    beats = {  # rank -> (position, seconds there at its last heartbeat)
        1: (Position(RUNNING, "load", site="data.py:7"), 30.0),  # stuck in its own code
        2: (Position(RUNNING, "augment", site="data.py:9"), 0.0),  # moving on: not named
        3: (_in("all_reduce"), 30.0),  # in the collective too
        4: (Position(RUNNING, DATALOADER_WAIT, site="train.py:40"), 12.0),
        5: (Position(RUNNING, "save", site="ckpt.py:3"), 5.0),
        6: (Position(RUNNING, "save", site="ckpt.py:3"), 5.0),
    }
    now = time.monotonic()
    for rank, (position, still_s) in beats.items():
        watchdog._beats[rank] = {**position.to_json(), "still_s": still_s}
        watchdog._heard_at[rank] = now
    assert watchdog.lost_contact() == (
        "every rank's heartbeat is recent; rank 1 was running data.py:7 (in load) for 30 s at "
        "its last heartbeat; rank 4 was waiting for a batch from its DataLoader's worker "
        "processes, at train.py:40 for 12 s at its last heartbeat; rank 5 was running ckpt.py:3 "
        "(in save) for 5 s at its last heartbeat; 1 more rank(s) likewise"
    )
