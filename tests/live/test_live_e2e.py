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
        command = [sys.executable, "-m", "ddpkit", "run", "-n", str(nproc),
                   "--fault-tolerance", "live", *flags, str(SCRIPT), str(out)]  # fmt: skip
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
            if progress.exists() and progress.read_text().strip().isdigit():
                if int(progress.read_text()) >= step:
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
        return [json.loads(line[6:]) for line in self.output.splitlines()
                if line.startswith("FINAL ")]  # fmt: skip


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

