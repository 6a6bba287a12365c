"""The README's own-loop example, copied out of README.md and run as a user would run it.

The block is written to ``train.py`` unchanged and run twice, as ``python train.py`` (one
process, no process group) and under ``ddpkit run -n 2``: first for 2 epochs, then again with
``EPOCHS=3`` in the same folder, where it must resume from its newest checkpoint (mid-epoch),
repeat the rest of that epoch with the same loss and accuracy as the first run, and go on.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from tests.helpers import run_cli

README = Path(__file__).resolve().parents[2] / "README.md"
SAMPLES, BATCH, EVERY_STEPS = 4096, 64, 20  # what the example uses
EPOCH_LINE = re.compile(r"epoch (\d+) step (\d+) loss (\S+) accuracy (\S+)")


def readme_example() -> str:
    """The README's ```python block that starts with ``# train.py``."""
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)
    examples = [b for b in blocks if b.startswith("# train.py")]
    assert len(examples) == 1, "README.md must hold exactly one python block starting # train.py"
    return examples[0]


def _epochs(output: str) -> list[tuple[int, int, str, str]]:
    return [(int(e), int(s), loss, acc) for e, s, loss, acc in EPOCH_LINE.findall(output)]


LAUNCHES = {
    "python": (1, ["train.py"]),
    "ddpkit_run": (2, ["-m", "ddpkit", "run", "-n", "2", "train.py"]),
}


@pytest.mark.parametrize("launch", sorted(LAUNCHES))
def test_readme_example_trains_and_resumes_at_the_saved_step(launch, tmp_path):
    world_size, command = LAUNCHES[launch]
    (tmp_path / "train.py").write_text(readme_example())
    per_epoch = SAMPLES // BATCH // world_size

    first = run_cli(command, env={"EPOCHS": "2"}, cwd=str(tmp_path), timeout_s=240)
    assert first.returncode == 0, first.output
    epochs = _epochs(first.output)
    assert [(e, s) for e, s, _, _ in epochs] == [(0, per_epoch), (1, 2 * per_epoch)], first.output
    losses = [float(loss) for _, _, loss, _ in epochs]
    assert all(math.isfinite(loss) for loss in losses) and losses[1] < losses[0], first.output
    assert float(epochs[1][3]) > 0.5  # held-out accuracy on 8 classes: it learns

    saved = 2 * per_epoch // EVERY_STEPS * EVERY_STEPS  # the newest checkpoint, mid-epoch 1
    assert saved < 2 * per_epoch
    second = run_cli(command, env={"EPOCHS": "3"}, cwd=str(tmp_path), timeout_s=240)
    assert second.returncode == 0, second.output
    assert f"(step {saved})" in second.output, second.output  # "resumed from ... (step N)"
    resumed = _epochs(second.output)
    assert [(e, s) for e, s, _, _ in resumed] == [(1, 2 * per_epoch), (2, 3 * per_epoch)]
    assert resumed[0] == epochs[1], (resumed, epochs)  # the same loss and accuracy: exact resume
    assert float(resumed[1][2]) < float(resumed[0][2]), second.output


@pytest.mark.parametrize("launch", sorted(LAUNCHES))
def test_readme_example_stops_on_sigterm_at_a_step_and_resumes_there(launch, tmp_path):
    # nothing in the example is about signals: its maybe_save(step) does it (issue 14)
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.helpers import descendants, pid_alive

    world_size, command = LAUNCHES[launch]
    (tmp_path / "train.py").write_text(readme_example())
    env = {**os.environ, "EPOCHS": "50", "PYTHONUNBUFFERED": "1"}
    first = tmp_path / "checkpoints" / "step-00000020" / "manifest.json"
    with open(tmp_path / "stderr", "w+") as stderr:
        proc = subprocess.Popen(
            [sys.executable, *command], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
            stderr=stderr, start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while not first.is_file():  # ready: the first periodic checkpoint is complete
                assert proc.poll() is None and time.monotonic() < deadline, "no step 20"
                time.sleep(0.02)
            started = descendants(proc.pid)
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                for pid in descendants(proc.pid):
                    os.kill(pid, signal.SIGKILL)
                proc.wait()
        stderr.seek(0)
        last = stderr.read().strip().splitlines()[-1]
    assert code == 143, last
    step = int(last.split(" after step ")[1].split(";")[0].split()[0])
    if launch == "python":
        assert last == (
            f"ddpkit: stopped by SIGTERM after step {step}; saved checkpoint "
            f"checkpoints/step-{step:08d}; rerun to resume."
        ), last
    else:
        assert last == (
            f"ddpkit run: stopped by SIGTERM after step {step}; all 2 processes stopped; saved: "
            f"checkpoint step-{step:08d} in checkpoints; resume with: ddpkit run -n 2 train.py"
        ), last
    assert not [pid for pid in started if pid_alive(pid)], "processes outlived the job"
    resumed = run_cli(command, env={"EPOCHS": str(step // (SAMPLES // BATCH // world_size) + 1)},
                      cwd=str(tmp_path), timeout_s=240)  # fmt: skip
    assert resumed.returncode == 0, resumed.output
    assert f"(step {step})" in resumed.output, resumed.output  # 0 lost steps
