"""The goodput split over a run's attempts (``ddpkit train``'s ``summary.json``)."""

from __future__ import annotations

import os
import time

import pytest

from ddpkit.app.mnist.goodput import (
    Goodput,
    goodput_line,
    process_start_time,
    read_attempts,
    summarize,
)
from ddpkit.env import ProcessInfo
from ddpkit.runtime.process_group import Runtime


def _attempt(restart, start, last, resumed, furthest, startup=2.0, loop=10.0, ckpt=1.0, ev=0.5):
    return {
        "restart": restart,
        "start_time": start,
        "last_time": last,
        "resumed_step": resumed,
        "furthest_step": furthest,
        "startup_s": startup,
        "loop_s": loop,
        "checkpoint_s": ckpt,
        "evaluation_s": ev,
        "end": "",
    }


def test_a_restart_recomputes_the_steps_past_the_resumed_checkpoint():
    first = _attempt(0, 100.0, 115.0, 0, 10)  # killed after step 10; 9 s of steps
    second = _attempt(1, 116.0, 130.0, 8, 20)  # torchrun restarted it 1 s later, from step 8
    split = summarize([first, second])
    assert split["wall_s"] == pytest.approx(15 + 14 + 1)  # the restart gap counts
    assert split["recomputed_steps"] == 2
    assert split["recomputed_s"] == pytest.approx(9 * 2 / 10)  # 2 of 10 steps, mean step time
    assert split["productive_s"] == pytest.approx(9 - 1.8 + 9)
    assert split["startup_s"] == pytest.approx(2 + 2 + 1)
    assert split["checkpoint_s"] == 2 and split["evaluation_s"] == 1
    assert split["other_s"] == pytest.approx(30 - 16.2 - 1.8 - 5 - 2 - 1)
    assert split["goodput"] == pytest.approx(16.2 / 30)
    assert (split["attempts"], split["restarts"]) == (2, 1)
    line = goodput_line(split)
    assert line.startswith("goodput 0.54: productive steps 16.2 s of 30.0 s wall;"), line
    assert "recomputed 1.8 s (2 steps)" in line and "(2 attempt(s), 1 restart(s))" in line


def test_a_rerun_after_a_stop_loses_nothing_and_its_queue_time_is_not_counted():
    stopped = _attempt(0, 100.0, 110.0, 0, 37)  # stopped after step 37, saved it
    rerun = _attempt(0, 500.0, 510.0, 37, 60)  # the user's rerun, much later
    split = summarize([stopped, rerun])
    assert split["recomputed_steps"] == 0 and split["recomputed_s"] == 0
    assert split["wall_s"] == pytest.approx(20) and split["restarts"] == 0


def test_the_attempt_record_is_rewritten_in_place_and_survives_a_kill(tmp_path):
    runtime = Runtime(ProcessInfo())
    goodput = Goodput(tmp_path, runtime, 0)
    goodput.start_steps()
    for step in range(1, 4):
        goodput.on_step(step, checkpoint_s=0.0)
    (record,) = read_attempts(tmp_path / "attempts")  # no finish(): as if killed here
    assert record["furthest_step"] == 3 and record["end"] == ""
    assert record["startup_s"] > 0 and record["loop_s"] >= 0
    split = goodput.finish("completed", checkpoint_s=0.0)
    assert split["attempts"] == 1 and read_attempts(tmp_path / "attempts")[0]["end"] == "completed"
    again = Goodput(tmp_path, runtime, 3)  # a resumed run: a second record beside the first
    again.finish("completed", checkpoint_s=0.0)
    assert len(read_attempts(tmp_path / "attempts")) == 2
    Goodput(tmp_path, runtime, 0)  # a fresh run starts the folder again
    assert len(list((tmp_path / "attempts").glob("attempt-*.json"))) == 1


def test_process_start_time_is_before_now():
    started = process_start_time()
    assert started <= time.time() and time.time() - started < 24 * 3600
    assert os.path.exists("/proc/self/stat")  # Linux: the kernel's own record was read
