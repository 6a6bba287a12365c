"""``ddpkit train --fault-tolerance live``: a rank killed mid-run, the job ends at its last epoch
with the live counters in summary.json; the one-cycle schedule follows the loader's position
(the world size changes the steps an epoch takes, and it must never step past its end)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ddpkit.app.mnist.schedule import LRStepper
from ddpkit.training.step import StepResult
from tests.helpers import descendants

pytestmark = pytest.mark.timeout(300)


def _is_worker(pid: int) -> bool:
    try:
        return b"ddpkit.launch.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def test_ddpkit_train_survives_a_killed_rank(tmp_path):
    out = tmp_path / "run"
    # a checkpoint every 20 steps: each save checks that every replica holds the same
    # parameters (a replacement's LR schedule once followed its own start-up world size: its
    # parameters parted from the survivor's at the first step after the heal, and the first
    # save after it refused to write)
    command = [
        sys.executable,
        "-m",
        "ddpkit",
        "train",
        "--nproc",
        "2",
        "--dataset",
        "digits",
        "--epochs",
        "160",
        "--output-dir",
        str(out),
        "--progress",
        "off",
        "--checkpoint-every",
        "20",
        "--fault-tolerance",
        "live",
        "--heartbeat-timeout",
        "30",
    ]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not (out / "metrics.csv").exists() or len((out / "metrics.csv").read_text().split()) < 6:
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0]
        time.sleep(0.1)  # a few epochs done
    workers = sorted(pid for pid in descendants(proc.pid) if _is_worker(pid))
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)
    try:
        output, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(proc.communicate()[0])
    assert proc.returncode == 0, output
    assert "live: completed; 1 failure(s) survived: slot 1 died (SIGKILL)" in output, output
    assert "slot(s) 1 healed from slot 0" in output, output
    assert "ReplicaDivergenceError" not in output, output
    summary = json.loads((out / "summary.json").read_text())
    live = summary["goodput"]["live"]
    assert live["failures"] == 1 and live["discarded_steps"] <= 1, summary["goodput"]
    assert summary["test_accuracy"] > 0.9, summary


def test_the_schedule_follows_the_position_and_never_passes_its_end():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=20)
    stepper = LRStepper(schedule, epochs=2)  # 10 schedule steps per epoch
    result = StepResult(
        step=1, loss_sums=(0.0,), num_samples=4, num_samples_global=8, skipped=False
    )
    stepper.step(result, {"epoch": 0, "samples_done": 30, "epoch_samples": 100})
    assert schedule.last_epoch == 3  # 30 % of the epoch: 3 of its 10 schedule steps
    stepper.step(result, {"epoch": 0, "samples_done": 32, "epoch_samples": 100})
    assert schedule.last_epoch == 3  # a smaller global batch: no step yet
    stepper.step(result, {"epoch": 1, "samples_done": 0, "epoch_samples": 0})
    assert schedule.last_epoch == 10
    stepper.step(result, {"epoch": 2, "samples_done": 0, "epoch_samples": 0})
    stepper.step(result, {"epoch": 2, "samples_done": 5, "epoch_samples": 100})
    assert schedule.last_epoch == 20  # its end, never past it (torch would raise)


def test_a_healed_schedule_follows_the_total_steps_its_peer_sent():
    """A replacement built its OneCycleLR for the world size it started at (here 1: 40 steps an
    epoch); the heal loads the survivors' (2 ranks: 20). The stepper follows the loaded one,
    so its LR is the survivors' LR at the same position."""

    def build(total_steps):
        opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=total_steps)

    survivor, replacement = build(40), build(80)
    result = StepResult(
        step=1, loss_sums=(0.0,), num_samples=4, num_samples_global=8, skipped=False
    )
    LRStepper(survivor, epochs=2).step(
        result, {"epoch": 0, "samples_done": 50, "epoch_samples": 100}
    )
    stepper = LRStepper(replacement, epochs=2)
    replacement.load_state_dict(survivor.state_dict())  # the heal
    stepper.step(result, {"epoch": 1, "samples_done": 0, "epoch_samples": 100})
    LRStepper(survivor, epochs=2).step(
        result, {"epoch": 1, "samples_done": 0, "epoch_samples": 100}
    )
    assert replacement.last_epoch == survivor.last_epoch == 20
    assert replacement.get_last_lr() == survivor.get_last_lr()
