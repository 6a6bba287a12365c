"""The hint under a rank that died from SIGKILL: the kernel's out-of-memory kill counters decide
whether it was the out-of-memory killer, with the machine's memory and the fix. Real kills (a
``kill -9``, a real out-of-memory kill in a cgroup) are in tests/cli/test_oom_kill.py."""

from __future__ import annotations

import pytest

from ddpkit.diagnostics.disk import format_bytes
from ddpkit.launch.launcher import LaunchSpec
from ddpkit.launch.oom import VMSTAT, OomWatch, machine_memory, oom_kill_counts, sigkill_hint
from ddpkit.launch.summary import summarize_failure

SPEC = LaunchSpec(["x.py"], 2)


def test_the_hint_goes_under_a_sigkilled_rank_and_nowhere_else():
    hints = {1: "what the SIGKILL was"}
    lines = summarize_failure([], {0: -15, 1: -9}, SPEC, kill_hints=hints)
    assert lines[:2] == [
        "ddpkit run: first failure: rank 1/2 died from signal SIGKILL without a Python exception.",
        "ddpkit run: hint: what the SIGKILL was",
    ]
    segfault = summarize_failure([], {0: -15, 1: -11}, SPEC, kill_hints={1: "x"})
    assert not any("hint: x" in line for line in segfault)


def _vmstat_count() -> int:
    counts = oom_kill_counts()
    if VMSTAT not in counts:
        pytest.skip(f"{VMSTAT} has no oom_kill counter here")
    return counts[VMSTAT]


def test_a_machine_counter_that_did_not_move_says_it_was_not_the_oom_killer():
    count = _vmstat_count()
    hint = sigkill_hint(OomWatch({VMSTAT: count}, 0.0), 1, 4242, nproc=2, command="ddpkit run")
    assert hint == (
        f"not the kernel's out-of-memory killer (oom_kill in /proc/vmstat, which counts every "
        f"kill on this machine, stayed at {count} during the job): something else sent SIGKILL "
        "to rank 1 (pid 4242): `kill -9`, a batch scheduler's time or resource limit, a "
        "container runtime."
    )


def test_a_counter_that_rose_during_the_job_says_it_most_likely_was():
    count = _vmstat_count()
    watch = OomWatch({VMSTAT: count - 1}, 0.0)  # one kill since the job started
    hint = sigkill_hint(watch, 1, 0, nproc=3, command="ddpkit train")
    assert hint.startswith(
        f"the kernel's out-of-memory killer ran during the job (oom_kill in /proc/vmstat: "
        f"{count - 1} -> {count}) and most likely ended rank 1; `dmesg` or `journalctl -k` "
        "shows 'Killed process PID' if so. "
    ), hint
    # what the job's processes held (none here: this test started none), the machine's memory
    assert f"emory: {format_bytes(machine_memory())} on this machine. " in hint
    assert hint.endswith(
        "Use fewer processes (--nproc 2), a smaller --batch-size, or a machine or cgroup with "
        "more memory."
    ), hint


def test_without_counters_it_says_what_a_sigkill_most_often_is():
    hint = sigkill_hint(OomWatch({}, 0.0), 0, 0, nproc=1, command="ddpkit run")
    assert hint.startswith(
        "rank 0 died from a SIGKILL that ddpkit did not send: most often the kernel's "
        "out-of-memory killer; `dmesg` or `journalctl -k` shows 'Killed process PID' if so. "
    ), hint
    assert hint.endswith("Use a smaller batch per rank, or a machine or cgroup with more memory.")
