"""The launcher's one line after a stop signal, from the workers' stop records."""

from __future__ import annotations

import json
import signal
from dataclasses import asdict

from ddpkit.diagnostics.failures import RUN_DIR_ENV, FailureRecord, StopRecord, note_checkpoint
from ddpkit.launch.launcher import LaunchSpec
from ddpkit.launch.stopping import signals_to_handle, stop_line

SPEC = LaunchSpec(target=["train.py"], nproc=2, resume_command="ddpkit run -n 2 train.py")


def _record(run_dir, rank: int, *, step=250, now=False, sig="SIGTERM", saved=True, time_s=1.0):
    record = StopRecord(
        rank=rank,
        world_size=2,
        restart=0,
        pid=100 + rank,
        signal=sig,
        now=now,
        step=None if now else step,
        checkpoint=f"{run_dir}/ck/step-{step:08d}",
        saved=saved,
        note="",
        time_s=time_s,
    )
    (run_dir / f"stop-r0-rank{rank}.json").write_text(json.dumps(asdict(record)))


def test_every_rank_stopped_at_the_step_and_saved_it(tmp_path):
    _record(tmp_path, 0)
    _record(tmp_path, 1)
    line, code = stop_line(SPEC, str(tmp_path), signal.SIGTERM)
    assert code == 143
    assert line == (
        "ddpkit run: stopped by SIGTERM after step 250; all 2 processes stopped; saved: "
        f"checkpoint step-00000250 in {tmp_path}/ck; resume with: ddpkit run -n 2 train.py"
    )


def test_a_signal_that_reached_only_the_workers_gives_their_signal(tmp_path):
    _record(tmp_path, 0, sig="SIGUSR1")
    _record(tmp_path, 1, sig="SIGUSR1")
    line, code = stop_line(SPEC, str(tmp_path), None)
    assert code == 138 and line.startswith("ddpkit run: stopped by SIGUSR1 after step 250;")


def test_a_rank_without_a_record_was_killed_at_the_end_of_the_grace_period(tmp_path):
    _record(tmp_path, 0)
    line, code = stop_line(SPEC, str(tmp_path), signal.SIGTERM)
    assert code == 143
    assert "after step 250, but local rank(s) 1 did not stop within the grace period (30 s)" in line
    assert "the newest complete checkpoint is step-00000250" in line


def test_a_second_signal_is_reported_as_a_stop_now(tmp_path):
    _record(tmp_path, 0, now=True)
    _record(tmp_path, 1, now=True)
    line, _ = stop_line(SPEC, str(tmp_path), signal.SIGTERM)
    assert "stopped by SIGTERM at once (a second SIGTERM);" in line
    assert "; the newest complete checkpoint is " in line


def test_a_signal_that_came_as_the_job_finished_says_it_completed(tmp_path):
    for rank in range(2):
        (tmp_path / f"done-r0-rank{rank}").touch()
    line, code = stop_line(SPEC, str(tmp_path), signal.SIGINT)
    assert code == 0 and line == (
        "ddpkit run: SIGINT arrived as the job was finishing: it completed (all 2 processes ran "
        "to their end)."
    )


def test_no_record_and_no_completion(tmp_path):
    line, code = stop_line(SPEC, str(tmp_path), signal.SIGINT)
    assert code == 130
    assert line.startswith("ddpkit run: interrupted (Ctrl-C) before the ranks agreed on a step")
    assert line.endswith("; no checkpoint was saved; resume with: ddpkit run -n 2 train.py")


def test_ranks_killed_before_recording_still_leave_the_newest_checkpoint_named(
    tmp_path, monkeypatch
):
    # e.g. a second Ctrl-C: torchrun kills the ranks before their stop records are written;
    # the job's CheckpointManager told the launcher of step-00000020 when it saved it
    (tmp_path / "ck" / "step-00000020").mkdir(parents=True)
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))
    note_checkpoint(tmp_path / "ck" / "step-00000020")
    line, code = stop_line(SPEC, str(tmp_path), signal.SIGINT)
    assert code == 130 and "no checkpoint was saved" not in line
    assert line.endswith(
        f"; the newest complete checkpoint is step-00000020 in {tmp_path / 'ck'}; resume with: "
        "ddpkit run -n 2 train.py"
    ), line


def test_torchrun_handles_its_own_signals_and_the_stop_signals():
    stops = (signal.SIGTERM, signal.SIGUSR1)
    assert signals_to_handle(stops) == "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def _peer_ended(run_dir, rank: int, *, time_s: float) -> None:
    failure = FailureRecord(
        rank=rank,
        local_rank=rank,
        world_size=2,
        restart=0,
        type="DistributedError",
        message="all_gather_object failed on rank 0/2: a peer's process ended during it\nmore",
        traceback="",
        time_s=time_s,
        pid=100 + rank,
    )
    (run_dir / f"failure-r0-rank{rank}.json").write_text(json.dumps(asdict(failure)))


def test_a_rank_that_failed_during_the_stop_is_named_not_a_stop_never_asked(tmp_path):
    # SIGTERM, then rank 1 SIGKILLed during the stop's save: rank 0's next collective fails
    _peer_ended(tmp_path, 0, time_s=2.0)
    line, code = stop_line(SPEC, str(tmp_path), signal.SIGTERM)
    assert code == 143
    assert line.startswith(
        "ddpkit run: stopped by SIGTERM, but the job failed before every rank stopped at a step "
        "(first failure: rank 0/2 (local rank 0, pid 100): DistributedError: all_gather_object "
        "failed on rank 0/2: a peer's process ended during it); all 2 processes stopped; "
    ), line
    assert "the ranks agreed" not in line


def test_a_peer_failing_after_a_rank_stopped_at_once_is_the_stop_now(tmp_path):
    # the second signal: rank 0 stops at once while rank 1 is inside a collective with it, which
    # fails ("a peer's process ended") before rank 1's own handler runs (a CI run, 2026-12-02)
    _record(tmp_path, 0, now=True, time_s=1.0)
    _peer_ended(tmp_path, 1, time_s=1.2)
    line, code = stop_line(SPEC, str(tmp_path), signal.SIGTERM)
    assert code == 143
    assert line.startswith("ddpkit run: stopped by SIGTERM at once (a second SIGTERM); all 2 ")
    # a failure before the stop now is still the job's failure
    _peer_ended(tmp_path, 1, time_s=0.5)
    line, _ = stop_line(SPEC, str(tmp_path), signal.SIGTERM)
    assert "but the job failed before every rank stopped at a step (first failure: rank 1/2" in line
