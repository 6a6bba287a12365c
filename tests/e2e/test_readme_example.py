"""The README's own-loop example, copied out of README.md and run as a user would run it.

The block is written to ``train.py`` unchanged and run twice, as ``python train.py`` (one
process, no process group) and under ``ddpkit run -n 2``: first for 2 epochs, then again with
``EPOCHS=3`` in the same folder, where it must resume from its newest checkpoint (mid-epoch),
repeat the rest of that epoch with the same loss and accuracy as the first run, and go on. A
third test runs it under plain ``torchrun`` on 2 ranks, then on 4 from the same folder.
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


def test_readme_example_resumes_under_torchrun_on_another_number_of_ranks(tmp_path):
    """A checkpoint of 2 ranks resumed by ``torchrun --nproc-per-node 4`` with the same file."""
    (tmp_path / "train.py").write_text(readme_example())
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    first = run_cli(
        [*torchrun, "2", "train.py"], env={"EPOCHS": "1"}, cwd=str(tmp_path), timeout_s=240
    )
    assert first.returncode == 0, first.output
    per_epoch = SAMPLES // BATCH // 2  # 32 steps of 64 x 2; checkpoints at 20 (mid-epoch) only
    assert [(e, s) for e, s, _, _ in _epochs(first.output)] == [(0, per_epoch)], first.output
    second = run_cli(
        [*torchrun, "4", "train.py"], env={"EPOCHS": "2"}, cwd=str(tmp_path), timeout_s=240
    )
    assert second.returncode == 0, second.output
    assert "(step 20) on 4 ranks, written by 2: the data goes on" in second.output
    # the rest of epoch 0 is 4096 - 20 x 128 = 1536 samples: 6 steps of 64 x 4 ranks, so every
    # remaining sample once (the loader's own count); then whole epochs of 16 steps
    assert [(e, s) for e, s, _, _ in _epochs(second.output)] == [(0, 26), (1, 42)], second.output


README_MODEL = (
    "    model = ddpkit.wrap_model("
    "nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 8)), rt)"
)
BATCHNORM_CNN = """\
    net = nn.Sequential(nn.Unflatten(1, (1, 8)), nn.Conv1d(1, 16, 3, padding=1),
                        nn.BatchNorm1d(16), nn.ReLU(), nn.Flatten(), nn.Linear(128, 8))
    model = ddpkit.wrap_model(net, rt, sync_batchnorm=True, bucket_cap_mb=5)
    print("norm layer:", type(ddpkit.unwrap_model(model)[2]).__name__, flush=True)"""


@pytest.mark.parametrize("launch", sorted(LAUNCHES))
def test_readme_pattern_with_a_batchnorm_cnn_and_sync_batchnorm(launch, tmp_path):
    # A port of the README's loop to a BatchNorm CNN with DDP options (#16 §4): the same file
    # runs as `python train.py` (the options do nothing, said in one info line) and on 2 ranks.
    world_size, command = LAUNCHES[launch]
    example = readme_example()
    assert example.count(README_MODEL) == 1
    (tmp_path / "train.py").write_text(example.replace(README_MODEL, BATCHNORM_CNN))
    result = run_cli(command, env={"EPOCHS": "2"}, cwd=str(tmp_path), timeout_s=240)
    assert result.returncode == 0, result.output
    per_epoch = SAMPLES // BATCH // world_size
    epochs = _epochs(result.output)
    assert [(e, s) for e, s, _, _ in epochs] == [(0, per_epoch), (1, 2 * per_epoch)]
    assert float(epochs[1][3]) > 0.5, result.output  # held-out accuracy on 8 classes
    layers = re.findall(r"norm layer: (\w+)", result.stdout)
    synced = ["CpuSyncBatchNorm"] * 2  # torch's SyncBatchNorm needs CUDA; ddpkit's on gloo
    assert layers == (synced if world_size > 1 else ["BatchNorm1d"]), result.output
    ignored = "sync_batchnorm=True, bucket_cap_mb=5: DDP options, in effect with 2 or more"
    assert (ignored in result.output) == (world_size == 1), result.output


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
            [sys.executable, *command],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )
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
    resumed = run_cli(
        command,
        env={"EPOCHS": str(step // (SAMPLES // BATCH // world_size) + 1)},
        cwd=str(tmp_path),
        timeout_s=240,
    )
    assert resumed.returncode == 0, resumed.output
    assert f"(step {step})" in resumed.output, resumed.output  # 0 lost steps
