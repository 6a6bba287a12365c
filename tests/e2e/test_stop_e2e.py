"""``ddpkit train`` stopped by a signal (issue 14): to the launcher, to one rank, to every process;
a second signal during the save; a signal during evaluation; a save that cannot fit the grace
period; and the same job under plain torchrun.

Each test runs the job as a user would (2 ranks, the digits data), waits for a step record (a
ready condition, never a sleep) before signalling, and checks the exit status, the last line
(the step and the command that resumes), that the newest checkpoint verifies and is at the
step the ranks stopped at, and that no process outlives the job.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ddpkit.checkpoint.io import list_checkpoints, load_checkpoint
from ddpkit.checkpoint.lock import LOCK_NAME
from ddpkit.runtime.stop import DUPLICATE_WINDOW_S
from tests.helpers import descendants, fault_env, pid_alive, run_cli
from tests.mnist_job import train_in_process

TRAIN = ["-m", "ddpkit", "train", "--dataset", "digits", "--nproc", "2", "--log-every", "1"]
EPOCHS = ["--epochs", "5"]  # 12 steps per epoch on 2 ranks: 60 in all
STOP_LINE = re.compile(
    r"^ddpkit train: (?:stopped by (SIG\w+)|interrupted \(Ctrl-C\)) after step (\d+) "
    r"\(epoch \d+/5\); all 2 processes stopped; saved: checkpoint (step-\d+) in (\S+); "
    r"resume with: (.+ --resume auto)$"
)


class Job:
    """A ``ddpkit train`` (or torchrun) job in its own session, its output in files."""

    def __init__(self, argv: list[str], out: Path, env: dict[str, str] | None = None) -> None:
        pytest.importorskip("sklearn")
        self.out = out
        self.stdout = open(out.parent / f"{out.name}.stdout", "w+")  # noqa: SIM115
        self.stderr = open(out.parent / f"{out.name}.stderr", "w+")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, *argv, "--output-dir", str(out)],
            stdout=self.stdout,
            stderr=self.stderr,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
        )
        self.started: set[int] = set()

    def wait_for(self, condition, what: str, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the job ended before {what}: {self.errors()}"
            if condition():
                self.started |= descendants(self.proc.pid)
                return
            time.sleep(0.02)
        pytest.fail(f"no {what} within {timeout_s} s: {self.errors()}")

    def wait_for_step(self, step: int) -> None:
        path = self.out / "steps.jsonl"

        def reached() -> bool:
            lines = path.read_text().splitlines() if path.exists() else []
            return any(json.loads(line)["step"] >= step for line in lines if line.endswith("}"))

        self.wait_for(reached, f"step {step} record")

    def workers(self) -> dict[int, int]:
        """rank -> pid of each worker (from its environment)."""
        found = {}
        for pid in descendants(self.proc.pid) - {self.proc.pid}:
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            ranks = [int(v[5:]) for v in env if v.startswith(b"RANK=")]
            if ranks and b"ddpkit.launch.worker" in cmdline:  # not its stderr copier
                found[ranks[0]] = pid
        return found

    def finish(self, timeout_s: float = 90) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not end within {timeout_s} s of the signal (a hang)")
        finally:
            if self.proc.poll() is None:
                for pid in descendants(self.proc.pid):
                    os.kill(pid, signal.SIGKILL)
                self.proc.wait()

    def errors(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()

    def output(self) -> str:
        self.stdout.seek(0)
        return self.stdout.read()

    def orphans(self) -> list[int]:
        return [pid for pid in self.started if pid_alive(pid)]


def _check_stopped(job: Job, code: int, sig: signal.Signals) -> tuple[int, list[str]]:
    """The exit status, the one last line, the newest checkpoint; returns (step, resume argv)."""
    errors = job.errors()
    assert code == 128 + sig, errors
    assert "Traceback" not in errors, errors
    last = errors.strip().splitlines()[-1]
    found = STOP_LINE.match(last)
    assert found, last
    name, step, folder, directory, resume = found.groups()
    assert sig == signal.SIGINT or name == sig.name, last
    newest = list_checkpoints(Path(directory))[0]
    assert newest.name == folder == f"step-{int(step):08d}", (newest, last)
    load_checkpoint(newest)  # complete: its checksum verifies (DataError otherwise)
    assert not list(Path(directory).glob(".tmp-*")), "a half-written checkpoint was left"
    assert job.orphans() == [], "processes outlived the job"
    return int(step), shlex.split(resume)


def _resumed_model(tmp_path: Path, resume: list[str], step: int) -> dict:
    assert resume[:2] == ["ddpkit", "train"]
    result = run_cli(["-m", "ddpkit", *resume[1:]], timeout_s=240)
    assert result.returncode == 0, result.output
    assert f"(step {step})" in result.stdout, result.stdout  # resumed at the step it stopped
    out = Path(resume[resume.index("--output-dir") + 1])
    return torch.load(out / "model.pt", weights_only=True)


def test_sigterm_to_the_launcher_stops_at_a_step_and_resumes_bitwise(tmp_path):
    job = Job([*TRAIN, *EPOCHS], tmp_path / "run")
    job.wait_for_step(10)
    os.kill(job.proc.pid, signal.SIGTERM)
    step, resume = _check_stopped(job, job.finish(), signal.SIGTERM)
    assert 10 <= step < 60
    assert len(job.errors().strip().splitlines()) == 1, job.errors()  # one line, no warnings
    resumed = _resumed_model(tmp_path, resume, step)
    # the uninterrupted reference checks the job only: in-process (tests/mnist_job.py)
    reference = train_in_process([*TRAIN[3:], *EPOCHS, "--output-dir", str(tmp_path / "ref")], 2)
    assert reference.summary["final_step"] == 60, reference.summary
    expected = torch.load(tmp_path / "ref" / "model.pt", weights_only=True)
    assert all(torch.equal(expected[k], resumed[k]) for k in expected)  # 0 lost steps, exact


def test_sigterm_to_one_rank_stops_every_rank(tmp_path):
    job = Job([*TRAIN, *EPOCHS], tmp_path / "run")
    job.wait_for_step(10)
    os.kill(job.workers()[1], signal.SIGTERM)  # the launcher gets nothing
    step, _ = _check_stopped(job, job.finish(), signal.SIGTERM)
    assert 10 <= step < 60


def test_sigusr1_to_every_process_is_one_request(tmp_path):
    # as Slurm's scancel --signal=USR1 does: the launcher and each rank get it, and torchrun
    # passes its own copy on too: each rank sees it twice, within milliseconds
    job = Job([*TRAIN, *EPOCHS], tmp_path / "run")
    job.wait_for_step(10)
    for pid in [job.proc.pid, *job.workers().values()]:
        os.kill(pid, signal.SIGUSR1)
    step, _ = _check_stopped(job, job.finish(), signal.SIGUSR1)
    assert 10 <= step < 60


def test_a_second_signal_during_the_save_stops_at_once_and_keeps_the_last_checkpoint(tmp_path):
    slow = fault_env(slow_save_s=4)  # every write (and the start-up probe) takes 4 s
    job = Job([*TRAIN, *EPOCHS, "--checkpoint-every", "8"], tmp_path / "run", env=slow)
    checkpoints = tmp_path / "run" / "checkpoints"
    job.wait_for(lambda: (checkpoints / "step-00000008" / "manifest.json").is_file(), "step 8")
    job.wait_for_step(9)
    os.kill(job.proc.pid, signal.SIGTERM)
    first = time.monotonic()

    def saving_and_not_a_duplicate() -> bool:  # the same signal within the window is the same
        late = time.monotonic() - first > DUPLICATE_WINDOW_S + 0.2
        return late and bool(list(checkpoints.glob(".tmp-step-*")))

    job.wait_for(saving_and_not_a_duplicate, "the stop's save")
    saving = list(checkpoints.glob(".tmp-step-*"))[0].name
    start = time.monotonic()
    os.kill(job.proc.pid, signal.SIGTERM)  # "stop now"
    code = job.finish()
    # cut short: the newest checkpoint below is older than the one being written (a finished
    # save would be the newest); the bound is a hang's, below the 30 s grace period
    assert time.monotonic() - start < 25, "the second signal did not end the job at once"
    errors = job.errors()
    assert code == 143, errors
    last = errors.strip().splitlines()[-1]
    assert last.startswith("ddpkit train: stopped by SIGTERM at once (a second SIGTERM); all 2 "), (
        last
    )
    assert "; the newest complete checkpoint is step-" in last and last.endswith("--resume auto")
    newest = list_checkpoints(checkpoints)[0]
    assert newest.name in last and newest.name < saving.split("-", 1)[1]  # an older, complete one
    load_checkpoint(newest)
    assert not list(checkpoints.glob(".tmp-*")), "the abandoned save was left behind"
    assert job.orphans() == []


def test_a_signal_during_evaluation_stops_at_the_next_step(tmp_path):
    slow = fault_env(slow_eval_s=3)
    job = Job([*TRAIN, *EPOCHS], tmp_path / "run", env=slow)
    job.wait_for_step(12)  # the last step of epoch 1: its evaluation comes next
    os.kill(job.proc.pid, signal.SIGTERM)
    step, resume = _check_stopped(job, job.finish(), signal.SIGTERM)
    assert 13 <= step < 60  # at a step after the evaluation: the next point the ranks agree
    records = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(records[0])["epoch"] == 1  # the evaluation it arrived in finished
    resumed = run_cli(["-m", "ddpkit", *resume[1:]], timeout_s=240)
    assert resumed.returncode == 0 and f"(step {step})" in resumed.stdout, resumed.output


def test_a_save_longer_than_the_grace_period_is_said_at_start_up(tmp_path):
    pytest.importorskip("sklearn")
    slow = fault_env(slow_save_s=3)
    argv = [*TRAIN, "--epochs", "1", "--max-steps", "2", "--grace-period", "2"]
    result = run_cli([*argv, "--output-dir", str(tmp_path / "run")], env=slow, timeout_s=180)
    assert result.returncode == 0, result.output
    (warning,) = [line for line in result.stderr.splitlines() if "grace-period" in line]
    assert warning.startswith("ddpkit train: warning: a checkpoint write takes 3."), warning
    assert "does not fit in --grace-period 2" in warning and "Raise --grace-period" in warning
    # the measurement left nothing (the folder itself holds the job's lock file alone)
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == [LOCK_NAME]


def test_plain_torchrun_passes_sigterm_on_and_the_ranks_stop_at_a_step(tmp_path):
    # for comparison: torchrun forwards SIGTERM and SIGKILLs after 30 s; ddpkit's ranks stop at
    # a step and save, and rank 0 says where (torchrun then prints its own SignalException)
    torchrun = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    job = Job([*torchrun, *TRAIN[:-4], "--log-every", "1", *EPOCHS], tmp_path / "run")
    job.wait_for_step(10)
    os.kill(job.proc.pid, signal.SIGTERM)
    job.finish()
    lines = [line for line in job.errors().splitlines() if line.startswith("ddpkit train:")]
    assert len(lines) == 1, job.errors()
    found = re.match(
        r"ddpkit train: stopped by SIGTERM after step (\d+) \(epoch \d/5\); saved: "
        r"checkpoint (step-\d+) in (\S+); resume: rerun the same torchrun command "
        r"with --resume auto$",
        lines[0],
    )
    assert found, lines[0]
    step, folder, directory = found.groups()
    assert list_checkpoints(Path(directory))[0].name == folder == f"step-{int(step):08d}"
    load_checkpoint(Path(directory) / folder)
    assert job.orphans() == []
