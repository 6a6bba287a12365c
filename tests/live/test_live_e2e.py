"""Live fault tolerance end to end: ``ddpkit run --fault-tolerance live`` on 2-3 real workers,
with faults injected from outside (SIGKILL, SIGSTOP, SIGTERM to one worker or the launcher).

What every test checks, besides its own fault: the survivors are the *same processes* (their
pids from start to end), the job ends with every member's parameters and optimizer state
bitwise equal (a SHA-256 of the parameters' bytes), and the event lines say what happened.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "live_loop.py"
pytestmark = pytest.mark.timeout(300)


class LiveJob:
    """A ``ddpkit run --fault-tolerance live`` job of the test script, in its own session."""

    def __init__(self, out: Path, nproc: int, *flags: str, env: dict[str, str] | None = None):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        if "--heartbeat-timeout" not in flags:  # a loaded CI machine: no false "silent"
            flags = ("--heartbeat-timeout", "30", *flags)
        command = [
            sys.executable,
            "-m",
            "ddpkit",
            "run",
            "-n",
            str(nproc),
            "--fault-tolerance",
            "live",
            *flags,
            str(SCRIPT),
            str(out),
        ]
        self.proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})},
            start_new_session=True,
        )
        self.output = ""

    def slots(self) -> dict[int, int]:
        """slot -> pid of the workers started so far that are still alive (newest per slot)."""
        found: dict[int, tuple[float, int]] = {}
        for path in self.out.glob("pid-*"):
            pid = int(path.name[4:])
            if _alive(pid):
                slot = int(path.read_text())
                stamp = path.stat().st_mtime
                if slot not in found or stamp > found[slot][0]:
                    found[slot] = (stamp, pid)
        return {slot: pid for slot, (_, pid) in found.items()}

    def wait_for_step(self, step: int, timeout_s: float = 150) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            progress = self.out / "progress"
            text = progress.read_text().strip() if progress.exists() else ""
            if text.isdigit() and int(text) >= step:
                return
            if self.proc.poll() is not None:
                pytest.fail(f"the job ended before step {step}:\n{self.finish()}")
            time.sleep(0.05)
        self.kill()
        pytest.fail(f"no step {step} within {timeout_s} s:\n{self.finish()}")

    def wait_for_file(self, name: str, timeout_s: float = 150) -> None:
        deadline = time.monotonic() + timeout_s
        while not (self.out / name).exists():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.kill()
                pytest.fail(f"no {name} within {timeout_s} s:\n{self.finish()}")
            time.sleep(0.02)

    def finish(self, timeout_s: float = 240) -> str:
        try:
            self.output, _ = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            self.output, _ = self.proc.communicate()
            pytest.fail(f"the job did not end within {timeout_s} s:\n{self.output}")
        return self.output

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)

    def finals(self) -> list[dict]:
        return [
            json.loads(line[6:]) for line in self.output.splitlines() if line.startswith("FINAL ")
        ]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.fixture
def job_dir(tmp_path):
    yield tmp_path


def _same_replicas(finals: list[dict], world_size: int, output: str) -> None:
    assert len(finals) == world_size, output
    assert {f["world_size"] for f in finals} == {world_size}, output
    assert sorted(f["rank"] for f in finals) == list(range(world_size)), output
    assert len({f["params_sha256"] for f in finals}) == 1, output  # bitwise equal replicas
    assert len({f["momentum"] for f in finals}) == 1, output
    assert len({f["step"] for f in finals}) == 1 and len({f["lr"] for f in finals}) == 1, output


def test_a_worker_killed_in_backward_leaves_its_peers_training_and_a_replacement_heals(job_dir):
    job = LiveJob(job_dir, 3, env={"STEP_S": "0.05", "EPOCHS": "16"})
    job.wait_for_step(12)
    before = job.slots()
    assert sorted(before) == [0, 1, 2]
    os.kill(before[1], signal.SIGKILL)  # most of a step is its backward's sleep
    output = job.finish()
    assert job.proc.returncode == 0, output
    assert "slot 1 died (SIGKILL)" in output, output
    assert "discarded on every member" in output or "committed" in output, output
    assert "slot(s) 1 healed from slot 0" in output, output
    finals = job.finals()
    _same_replicas(finals, 3, output)
    survivors = {f["pid"] for f in finals} & {before[0], before[2]}
    assert survivors == {before[0], before[2]}, output  # the same processes went on
    counters = [f["counters"] for f in finals if f["pid"] == before[0]][0]
    assert counters["failures"] == 1 and counters["discarded_steps"] <= 1, counters


def test_a_replacement_killed_while_it_heals_leaves_the_job_whole(job_dir):
    # the survivors take 3 s to produce the state they send (a slow state_dict of the
    # script's own): the replacement is killed inside that heal
    job = LiveJob(
        job_dir, 3, env={"STEP_S": "0.03", "EPOCHS": "30", "SLOW_HEAL_S": "3", "CKPT_EVERY": "0"}
    )
    job.wait_for_step(5)
    first = job.slots()
    os.kill(first[1], signal.SIGKILL)
    job.wait_for_file("healing")
    replacement = job.slots()[1]
    assert replacement != first[1]
    os.kill(replacement, signal.SIGKILL)
    output = job.finish()
    assert job.proc.returncode == 0, output
    assert output.count("ddpkit run: live: slot 1 died (SIGKILL)\n") == 2, output
    assert "slot(s) 1 healed from slot 0" in output, output  # the second replacement
    _same_replicas(job.finals(), 3, output)
    assert {f["pid"] for f in job.finals()} >= {first[0], first[2]}, output


def test_the_last_member_dying_ends_the_job_naming_the_newest_checkpoint(job_dir):
    job = LiveJob(job_dir, 2, "--max-restarts", "0", env={"STEP_S": "0.05", "EPOCHS": "40"})
    job.wait_for_step(30)  # a checkpoint at step 25 is complete
    slots = job.slots()
    os.kill(slots[1], signal.SIGKILL)
    job.wait_for_step(36)  # slot 0 trains on alone
    os.kill(slots[0], signal.SIGKILL)
    output = job.finish()
    assert job.proc.returncode == 1, output
    last = output.strip().splitlines()[-1]
    assert "job FAILED: no live member is left to go on (slot 0 died (SIGKILL))" in last, output
    newest = sorted((job_dir / "checkpoints").glob("step-*"))[-1]
    assert f"the newest complete checkpoint is {newest}" in last, output
    assert "again to resume from it" in last, output
    assert "slot 1: no replacement (--max-restarts 0); the others go on without it" in output


def test_a_stopped_worker_is_declared_dead_and_ended_while_its_peers_go_on(job_dir):
    job = LiveJob(job_dir, 3, "--heartbeat-timeout", "5", env={"STEP_S": "0.02", "EPOCHS": "16"})
    job.wait_for_step(10)
    slots = job.slots()
    os.kill(slots[2], signal.SIGSTOP)  # no crash, no closed connection: only silence
    output = job.finish()
    assert job.proc.returncode == 0, output
    assert "slot 2 stopped answering (no heartbeat for" in output, output
    assert not _alive(slots[2])  # ended by the launcher: it can never come back
    finals = job.finals()
    _same_replicas(finals, len(finals), output)
    assert {f["pid"] for f in finals} >= {slots[0], slots[1]}, output


def test_a_worker_leaving_on_its_own_signal_is_replaced_by_a_warm_spare(job_dir):
    job = LiveJob(job_dir, 3, "--spares", "1", env={"STEP_S": "0.02", "EPOCHS": "12"})
    job.wait_for_step(10)
    slots = job.slots()
    os.kill(slots[1], signal.SIGTERM)  # a preemption notice to this worker alone
    output = job.finish()
    assert job.proc.returncode == 0, output
    assert "slot 1 left (its own stop signal)" in output, output
    assert "slot 1: a warm spare takes over" in output, output
    assert "slot(s) 1 healed from slot 0" in output, output
    finals = job.finals()
    _same_replicas(finals, 3, output)
    assert slots[1] not in {f["pid"] for f in finals}


def test_a_stop_signal_to_the_launcher_stops_every_member_at_one_step(job_dir):
    job = LiveJob(job_dir, 3, env={"STEP_S": "0.02", "EPOCHS": "40"})
    job.wait_for_step(10)
    os.kill(job.proc.pid, signal.SIGTERM)
    output = job.finish()
    assert job.proc.returncode == 143, output
    line = output.strip().splitlines()[-1]
    step = int(line.split("after step ")[1].split(";")[0])
    assert line.startswith(f"ddpkit run: stopped by SIGTERM after step {step}; all 3"), output
    assert (job_dir / "checkpoints" / f"step-{step:08d}").is_dir(), output
    assert "resume with: ddpkit run -n 3 --fault-tolerance live" in line, output


def test_a_worker_hung_in_its_own_code_is_ended_after_the_timeouts(job_dir):
    # its heartbeat goes on: the peers' all-reduce times out (TRAIN_TIMEOUT), they wait as
    # long again for its vote, report it, and the launcher ends it
    job = LiveJob(job_dir, 3, env={"STEP_S": "0.02", "EPOCHS": "16", "TRAIN_TIMEOUT": "8"})
    job.wait_for_step(10)
    slots = job.slots()
    (job_dir / "hang-1").write_text("")
    deadline = time.monotonic() + 90
    while _alive(slots[1]) and time.monotonic() < deadline:
        time.sleep(0.1)
    (job_dir / "hang-1").unlink()  # its replacement, in the same slot, trains normally
    output = job.finish()
    assert job.proc.returncode == 0, output
    assert "slot 1 hung (its peers waited" in output, output
    assert not _alive(slots[1])
    finals = job.finals()
    _same_replicas(finals, len(finals), output)
    assert {f["pid"] for f in finals} >= {slots[0], slots[2]}, output


def test_a_stop_signal_to_every_worker_at_once_is_a_stop_with_a_checkpoint(job_dir):
    # Slurm's preemption signals every process of the job: the members whose leave lands in
    # one vote with the others' leave together = the job stops (those ahead may leave first)
    job = LiveJob(job_dir, 3, env={"STEP_S": "0.02", "EPOCHS": "40"})
    job.wait_for_step(10)
    for pid in job.slots().values():
        os.kill(pid, signal.SIGTERM)
    output = job.finish()
    line = output.strip().splitlines()[-1]
    assert job.proc.returncode == 143, output
    step = int(line.split("after step ")[1].split(";")[0])
    assert line.startswith(f"ddpkit run: stopped by SIGTERM after step {step}"), output
    assert (job_dir / "checkpoints" / f"step-{step:08d}").is_dir(), output
    assert "job FAILED" not in output, output
