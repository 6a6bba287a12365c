"""The launcher's closing summary: gloo's collective-mismatch abort named as that (which ranks,
which operation, which sizes), and ``--max-restarts`` advised only where a restart can help."""

from __future__ import annotations

import pytest

from ddpkit.diagnostics.failures import FailureRecord
from ddpkit.launch.launcher import LaunchSpec
from ddpkit.launch.summary import read_native_crash, summarize_failure

# The end of a real rank's stderr (ddpkit run -n 2; rank 0 all_reduced 4 floats, rank 1 8):
# libstdc++'s terminate message with gloo's enforce, then faulthandler's stacks.
ABORTED_TAIL = """\
terminate called after throwing an instance of 'gloo::EnforceNotMet'
  what():  [enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:456] \
op.preamble.length <= op.nbytes. 8 vs 4. Received data size doesn't match expected size. Is there \
a distributed collective mismatch in your code?
Fatal Python error: Aborted

Thread 0x00007fdaa2ffd6c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/site-packages/ddpkit/watchdog/monitor.py", line 182 in _run

Thread 0x00007fdad2418b80 (most recent call first):
  File "/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/site-packages/ddpkit/runtime/collectives.py", line 96 in all_reduce
  File "mm.py", line 3 in <module>
  File "<frozen runpy>", line 88 in _run_code
  File "/site-packages/ddpkit/launch/worker.py", line 129 in run_target

Extension modules: numpy._core._multiarray_umath, torch._C (total: 2)
"""
PEER_RESET = (
    "all_reduce failed on rank 1/2: a peer's process ended during it (Read error "
    "[127.0.0.1]:45227: Connection reset by peer. ...)"
)


def _record(rank, type_="RuntimeError", message="boom", collective="", time_s=10.0):
    return FailureRecord(rank, rank, 2, 0, type_, message, "", time_s, 100 + rank, "", collective)


def test_gloo_abort_is_read_from_the_stderr_tail():
    crash = read_native_crash(ABORTED_TAIL)
    assert (crash.received, crash.expected, crash.op, crash.site) == (8, 4, "all_reduce", "mm.py:3")
    assert not read_native_crash("Segmentation fault\n").mismatch


def test_collective_mismatch_is_named_with_ranks_operations_and_sizes():
    peer = _record(1, "DistributedError", PEER_RESET, "all_reduce of float32 (8,) at mm.py:3")
    lines = summarize_failure([peer], {0: -6, 1: 1}, LaunchSpec(["x.py"], 2), {0: ABORTED_TAIL})
    text = "\n".join(lines)
    assert lines[0] == (
        "ddpkit run: first failure: rank 0/2 aborted (SIGABRT): gloo found a collective "
        "mismatch: it received 8 bytes where it expected 4, in all_reduce called at mm.py:3."
    )
    assert (
        "hint: the ranks' collectives do not match: rank 0 all_reduce at mm.py:3 (expected 4 "
        "bytes, received 8); rank 1 all_reduce of float32 (8,) at mm.py:3." in text
    )
    assert "without a Python exception" not in text and "network" not in text
    assert lines[-1].endswith(
        "restarts are off (--max-restarts 0); a restart would fail the same way."
    )


def test_a_survivor_sigkilled_after_a_native_crash_is_the_stop_not_a_second_cause():
    # Under load rank 1 stays in gloo's all_reduce past torchrun's grace period: SIGKILL. That
    # is torchrun stopping it after rank 0's abort, not an out-of-memory kill to report first.
    spec = LaunchSpec(["x.py"], 2)
    oom_hint = {1: "this SIGKILL was not the out-of-memory killer: ..."}
    lines = summarize_failure([], {0: -6, 1: -9}, spec, {0: ABORTED_TAIL}, kill_hints=oom_hint)
    text = "\n".join(lines)
    assert lines[0].startswith("ddpkit run: first failure: rank 0/2 aborted (SIGABRT)")
    assert lines[1].startswith("ddpkit run: hint: the ranks' collectives do not match: rank 0")
    assert "SIGKILL" not in text and "out-of-memory" not in text, text
    assert lines[-1].endswith("a restart would fail the same way.")
    # With the kernel's evidence of an out-of-memory kill it stays a cause, listed first.
    oom = {1: "the kernel's out-of-memory killer ended rank 1 (pid 7); kernel log: '...'"}
    killed = summarize_failure([], {0: -6, 1: -9}, spec, {0: ABORTED_TAIL}, kill_hints=oom)
    assert killed[0].startswith("ddpkit run: first failure: rank 0/2 aborted (SIGABRT)")
    assert "rank 1/2 died from signal SIGKILL" in killed[1] and killed[2].endswith(oom[1])
    # Alone, a SIGKILL is still the cause, with its hint.
    alone = summarize_failure([], {1: -9, 0: -15}, spec, kill_hints=oom_hint)
    assert alone[0].startswith("ddpkit run: first failure: rank 1/2 died from signal SIGKILL")
    assert alone[1] == "ddpkit run: hint: this SIGKILL was not the out-of-memory killer: ..."


@pytest.mark.parametrize(
    "records,codes,restart_helps",
    [
        ([_record(1, "ValueError")], {1: 1, 0: -15}, False),  # a bug: it would fail again
        ([_record(1, "SystemExit", "exit status 3")], {1: 3}, False),
        ([_record(0, "DeadlockError", "deadlock: ...")], {0: 1, 1: -15}, False),
        ([], {1: -9}, True),  # killed (out of memory, preempted)
        ([_record(0, "StallError", "stall: ...")], {0: 1, 1: -15}, True),  # a timeout
        (
            [_record(1, "DistributedError", "x failed: a peer stopped answering (Timed out)")],
            {},
            True,
        ),
        ([_record(1, "RuntimeError", "... Connection closed by peer ...")], {}, True),
    ],
)
def test_restarts_are_advised_only_where_they_can_help(records, codes, restart_helps):
    last = summarize_failure(records, codes, LaunchSpec(["x.py"], 2))[-1]
    assert ("add --max-restarts N" in last) is restart_helps, last
    assert ("a restart would fail the same way" in last) is not restart_helps, last


def test_a_watchdog_report_shows_each_rank_in_the_summary():
    message = (
        "deadlock: the ranks wait in collectives that cannot match (for 5 s, found by rank 0):\n"
        "  rank 0: all_reduce on the default group (ranks 0, 1), called at t.py:9\n"
        "  rank 1: backward(), waiting for DDP's gradient all-reduce, called at t.py:7\n"
        "  Every rank must call the same collectives ...\n"
        "  --- stack of rank 0's training thread:\n"
        '    File "t.py", line 9, in <module>\n'
    )
    lines = summarize_failure(
        [_record(0, "DeadlockError", message)], {0: 1, 1: -9}, LaunchSpec(["x.py"], 2)
    )
    assert (
        "ddpkit run:   rank 1: backward(), waiting for DDP's gradient all-reduce, called at t.py:7"
        in lines
    )
    assert not any(
        "stack of rank" in line or "SIGKILL" in line for line in lines
    )  # stops: not causes


def test_a_peer_that_ran_to_its_end_is_named_not_sent_for():
    # rank 1 had one batch fewer: it finished (exit 0) while rank 0 waited in its last
    # all-reduce; the hint must not send the user to "the first failure in the other ranks'
    # output" (there is none) but say the ranks ran different numbers of collectives
    peer = _record(
        0,
        "DistributedError",
        PEER_RESET.replace("1/2", "0/2"),
        "all_reduce of float32 (8,) at train.py:20",
    )
    peer = FailureRecord(**{**peer.__dict__, "hint": "a peer's process ended: see its output"})
    lines = summarize_failure([peer], {0: 1}, LaunchSpec(["x.py"], 2), finished={1})
    text = "\n".join(lines)
    assert "see its output" not in text
    assert (
        "ddpkit run: hint: rank 1 ran its script to the end (exit status 0) while rank 0 was "
        "still in all_reduce of float32 (8,) at train.py:20: the ranks made different numbers "
        "of collective calls." in text
    ), text
    assert "build_train_loader" in text and "if rank == 0:" in text
    without = "\n".join(summarize_failure([peer], {0: 1}, LaunchSpec(["x.py"], 2)))
    assert "see its output" in without and "ran its script to the end" not in without


def test_the_failure_line_names_the_newest_checkpoint_a_manager_of_the_job_saved(
    tmp_path, monkeypatch
):
    import torch

    import ddpkit
    from ddpkit.diagnostics.failures import RUN_DIR_ENV
    from ddpkit.env import ProcessInfo
    from ddpkit.launch.launcher import _kept_after_failure

    spec = LaunchSpec(target=["train.py"], nproc=2, resume_command="ddpkit run -n 2 train.py")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert _kept_after_failure(spec, str(run_dir)) == ""  # no checkpoint: nothing to name
    monkeypatch.setenv(RUN_DIR_ENV, str(run_dir))  # as ddpkit run sets it for its workers
    state = {"model": torch.nn.Linear(2, 2)}
    ckpt = ddpkit.CheckpointManager(tmp_path / "ck", ddpkit.Runtime(ProcessInfo()), state=state)
    ckpt.save(10)
    ckpt.save(20)
    kept = _kept_after_failure(spec, str(run_dir))
    lines = summarize_failure([], {0: -9, 1: -15}, spec, kept=kept)
    assert lines[-1].endswith(
        f"; the newest complete checkpoint is step-00000020 in {tmp_path / 'ck'}; resume with: "
        "ddpkit run -n 2 train.py."
    ), lines[-1]
