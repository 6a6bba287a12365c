"""``ddpkit train --grad-accum``: steps count optimizer steps, and a killed, restarted job
resumes mid-epoch on a window boundary to the same parameters as an uninterrupted one."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import fault_env, run_cli
from tests.mnist_job import train_in_process

DIGITS_2_RANKS = ["-m", "ddpkit", "train", "--dataset", "digits", "--nproc", "2"]


def test_accumulating_job_restarts_and_resumes_to_the_same_parameters(tmp_path):
    pytest.importorskip("sklearn")
    # 12 batches per rank and epoch, K = 2: 6 optimizer steps per epoch, 12 in all
    flags = ["--epochs", "2", "--grad-accum", "2", "--checkpoint-every", "4"]
    common = [*DIGITS_2_RANKS, *flags]
    # the uninterrupted reference checks the job only: in-process (tests/mnist_job.py)
    plain_flags = ["--dataset", "digits", *flags, "--output-dir", str(tmp_path / "plain")]
    plain = train_in_process(plain_flags, nproc=2)
    assert plain.summary["final_step"] == 12, plain.summary
    assert "global batch 256" in plain.stdout
    # rank 1 dies at optimizer step 5; the restart resumes from step 4 (mid epoch 1: 8 of its
    # 12 batches done) and must skip exactly those
    faulty = run_cli(
        [*common, "--max-restarts", "1", "--output-dir", str(tmp_path / "faulty")],
        env=fault_env(kill_at="1:5"),
        timeout_s=240,
    )
    assert faulty.returncode == 0, faulty.output
    assert "step-00000004 (step 4)" in faulty.stdout
    summaries = [
        json.loads((tmp_path / d / "summary.json").read_text()) for d in ("plain", "faulty")
    ]
    assert summaries[0]["final_step"] == summaries[1]["final_step"] == 12  # optimizer steps
    models = [torch.load(tmp_path / d / "model.pt", weights_only=True) for d in ("plain", "faulty")]
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])
