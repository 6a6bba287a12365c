"""``ddpkit train --resume auto --nproc M``: a job of 2 processes that died mid-epoch goes on on 4
and on 1, with nothing else changed on the command line.

Digits, 2 epochs of 8 optimizer steps (``--max-steps 8``: whole global batches of 128, so every
step trains on the same 128 samples at any world size), a checkpoint every 4 steps, rank 1
SIGKILLed at step 6 without restarts. The resumed jobs say in one line how they split the global
batch (4 x 32 per rank; 1 x 64 per rank x 2 micro-steps), end at the same step, and log the
uninterrupted run's per-step losses within float reduction order.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.helpers import fault_env, run_cli
from tests.mnist_job import SHORT_JOB_FLAGS as FLAGS
from tests.mnist_job import step_losses as _losses
from tests.mnist_job import train_in_process

COMMON = ["-m", "ddpkit", "train", *FLAGS]
LOSS_RTOL = 1e-6  # float32; tests/distributed/test_resize_resume.py measures the margin


def test_a_killed_two_process_job_resumes_on_four_and_on_one(tmp_path):
    pytest.importorskip("sklearn")
    # the uninterrupted reference checks the job only: in-process (tests/mnist_job.py)
    plain = train_in_process([*FLAGS, "--output-dir", str(tmp_path / "plain")], nproc=2)
    assert plain.summary["final_step"] == 16, plain.summary
    faulty = run_cli(
        [*COMMON, "--nproc", "2", "--output-dir", str(tmp_path / "killed")],
        env=fault_env(kill_at="1:6"),
        timeout_s=180,
    )
    assert faulty.returncode == 1, faulty.output
    shutil.copytree(tmp_path / "killed", tmp_path / "killed-1")
    reference = _losses(tmp_path / "plain")
    expected_model = torch.load(tmp_path / "plain" / "model.pt", weights_only=True)
    for out, nproc, split in (("killed", 4, "32 per rank x 1"), ("killed-1", 1, "64 per rank x 2")):
        resumed = run_cli(
            [
                *COMMON,
                "--nproc",
                str(nproc),
                "--resume",
                "auto",
                "--output-dir",
                str(tmp_path / out),
            ],
            timeout_s=180,
        )
        assert resumed.returncode == 0, resumed.output
        assert resumed.stdout.count("the global batch stays") == 1  # one info line, rank 0
        assert (
            f"resuming step-00000004 (written on 2 process(es)) on {nproc}: the global batch "
            f"stays 128 = {split} micro-step(s) x {nproc}"
        ) in resumed.stdout
        assert "step-00000004 (step 4)" in resumed.stdout
        summary = json.loads((tmp_path / out / "summary.json").read_text())
        assert summary["final_step"] == 16 and summary["world_size"] == nproc
        losses = _losses(tmp_path / out)
        assert sorted(losses) == list(range(1, 17))  # steps 1-4 kept, 5-16 trained again
        for step in range(5, 17):
            assert losses[step] == pytest.approx(reference[step], rel=LOSS_RTOL), step
        model = torch.load(tmp_path / out / "model.pt", weights_only=True)
        for key, value in expected_model.items():  # 12 Adam steps after the change
            assert torch.allclose(model[key], value, rtol=1e-4, atol=1e-6), key
