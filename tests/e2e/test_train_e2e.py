"""The main job end to end, as a user runs it: ``ddpkit train`` on 2 processes.

The full epoch (accuracy >= 0.985) takes about a minute on two cores and is recorded in the
README; here a shortened run checks the wiring: real MNIST, DDP over 2 ranks, exact evaluation
of all 10,000 test images, the three output files.
"""

from __future__ import annotations

import json
import shlex

import pytest
import torch

from ddpkit.app.mnist.goodput import FOLDER as ATTEMPTS_FOLDER
from ddpkit.app.mnist.goodput import read_attempts
from tests.helpers import fault_env, run_cli
from tests.mnist_job import train_in_process

DIGITS_2_RANKS = ["-m", "ddpkit", "train", "--dataset", "digits", "--nproc", "2"]


def _train_digits(*flags: str, env: dict | None = None, timeout_s: float = 180):
    pytest.importorskip("sklearn")
    return run_cli([*DIGITS_2_RANKS, *flags], env=env, timeout_s=timeout_s)


def _summary_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("ddpkit train:")]


def test_train_mnist_two_processes(mnist_dir, tmp_path):
    out = tmp_path / "run"
    result = run_cli(
        [
            "-m",
            "ddpkit",
            "train",
            "--data-dir",
            str(mnist_dir),
            "--nproc",
            "2",
            "--epochs",
            "1",
            "--max-steps",
            "60",
            "--output-dir",
            str(out),
        ],
        timeout_s=180,
    )
    assert result.returncode == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["test_samples"] == 10000
    assert summary["world_size"] == 2 and summary["backend"] == "gloo"
    assert summary["dataset"] == "mnist" and summary["epochs"] == 1
    assert summary["test_accuracy"] > 0.85  # 60 steps of 128 images already learn a lot
    assert summary["samples_per_s"] > 0 and summary["wall_s"] > 0
    # no hook at default: the bytes are every gradient once per step (DDP's built-in all-reduce)
    from ddpkit.app.mnist.model import MnistCNN

    grad_bytes = sum(p.numel() * p.element_size() for p in MnistCNN().parameters())
    assert summary["comm_bytes_per_step"] == grad_bytes
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 1 and records[0]["test_accuracy"] == summary["test_accuracy"]
    state = torch.load(out / "model.pt", weights_only=True)
    assert state and not any(key.startswith("module.") for key in state)
    assert result.stdout.count("epoch 1/1") == 1  # printed once, by rank 0
    assert "test_acc" in result.stdout and "samples/s" in result.stdout


def test_train_offline_without_files_uses_digits(tmp_path):
    pytest.importorskip("sklearn")
    out = tmp_path / "run"
    result = run_cli(
        [
            "-m",
            "ddpkit",
            "train",
            "--nproc",
            "2",
            "--epochs",
            "3",
            "--output-dir",
            str(out),
            "--max-restarts",
            "1",
        ],
        env={
            "DDPKIT_CACHE_DIR": str(tmp_path / "cache"),
            "DDPKIT_MNIST_MIRRORS": "http://127.0.0.1:1/",
        },  # loopback, nothing listening
        timeout_s=180,
    )
    assert result.returncode == 0, result.output
    assert result.stdout.count("MNIST unavailable") == 1
    assert (
        "--max-restarts without --checkpoint-every: a restarted job starts again" in result.stderr
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dataset"] == "digits" and summary["test_samples"] == 360
    assert summary["test_accuracy"] > 0.8


def test_killed_rank_restarts_and_resumes_to_the_same_parameters(tmp_path):
    pytest.importorskip("sklearn")
    common = ["--epochs", "2", "--checkpoint-every", "4"]  # 12 steps per epoch, 24 in all
    # --resume auto with nothing to resume says so and starts at step 0 (the job's behaviour:
    # in-process, tests/mnist_job.py; the restart below is the launcher's, a real command)
    plain_flags = [*common, "--resume", "auto", "--output-dir", str(tmp_path / "plain")]
    plain = train_in_process(["--dataset", "digits", *plain_flags], nproc=2)
    assert plain.summary["final_step"] == 24, plain.summary
    assert "--resume auto: no complete checkpoint in " in plain.output
    assert "starting from step 0" in plain.output
    # rank 1 is SIGKILLed at step 10 in the first attempt; the restart resumes from step 8
    faulty = _train_digits(
        *common,
        "--max-restarts",
        "1",
        "--output-dir",
        str(tmp_path / "faulty"),
        env=fault_env(kill_at="1:10"),
        timeout_s=240,
    )
    assert faulty.returncode == 0, faulty.output
    assert "ddpkit train: workers FAILED; restarting them (restart 1 of 1)." in faulty.stderr
    assert "resumed from" in faulty.stdout and "step-00000008 (step 8)" in faulty.stdout
    restart_line = "ddpkit: restart 1 of 1: the job failed (the error above); all 2 processes"
    assert faulty.stderr.count(restart_line) == 1 and "ddpkit: restart" not in plain.output
    runs = ("plain", "faulty")
    summaries = [json.loads((tmp_path / d / "summary.json").read_text()) for d in runs]
    assert summaries[0]["final_step"] == summaries[1]["final_step"] == 24
    models = [torch.load(tmp_path / d / "model.pt", weights_only=True) for d in runs]
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])
    # the resumed epoch's record covers the whole epoch (#16 §3): steps 1-8 of the first attempt
    # and 9-12 of the restart. Both runs fold their sums at the same checkpoint steps (4, 8,
    # 12), so the loss and samples are bitwise equal; the seconds are the two attempts' parts.
    plain_epochs, faulty_epochs = (_records(tmp_path / d / "metrics.jsonl") for d in runs)
    assert [r["epoch"] for r in faulty_epochs] == [1, 2]
    for plain_record, faulty_record in zip(plain_epochs, faulty_epochs, strict=True):
        assert faulty_record["train_loss"] == plain_record["train_loss"]
        assert faulty_record["test_accuracy"] == plain_record["test_accuracy"]
        assert plain_record["resumed_at_step"] is None and plain_record["whole_epoch"] is True
    resumed = faulty_epochs[0]
    assert resumed["train_samples"] == plain_epochs[0]["train_samples"] == 1438  # 719 per rank
    assert resumed["samples_per_s"] * resumed["epoch_s"] == pytest.approx(1438)
    assert resumed["resumed_at_step"] == 8 and resumed["whole_epoch"] is True
    assert faulty_epochs[1]["resumed_at_step"] is None  # epoch 2 ran in one go
    assert "(whole epoch, resumed at step 8)" in faulty.stdout
    assert "differs across ranks" not in faulty.output  # the saved sums are every rank's
    assert "resumed at step" not in plain.stdout

    # goodput (#14 section 5): the restart's time and the 2 steps past step 8 trained twice
    once, twice = (s["goodput"] for s in summaries)
    assert (once["attempts"], once["restarts"], once["recomputed_steps"]) == (1, 0, 0)
    assert (twice["attempts"], twice["restarts"], twice["recomputed_steps"]) == (2, 1, 2)
    assert twice["recomputed_s"] > 0 and once["recomputed_s"] == 0
    for split in (once, twice):
        parts = ("productive_s", "checkpoint_s", "startup_s", "recomputed_s", "evaluation_s")
        assert all(split[k] >= 0 for k in parts) and split["startup_s"] > 0
        assert sum(split[k] for k in parts) + split["other_s"] == pytest.approx(split["wall_s"])
        assert split["goodput"] == pytest.approx(split["productive_s"] / split["wall_s"])
    # the restart's start-up and torchrun's gap are counted: both attempts left a record. (Not
    # compared with the plain run's figures: two timed runs differ by more than a start-up under
    # load, and the goodput of each is below 3 % on this tiny job.)
    attempts = read_attempts(tmp_path / "faulty" / ATTEMPTS_FOLDER)
    assert [a["restart"] for a in attempts] == [0, 1] and all(a["startup_s"] > 0 for a in attempts)
    assert twice["startup_s"] >= sum(a["startup_s"] for a in attempts)
    assert [a["restart"] for a in read_attempts(tmp_path / "plain" / ATTEMPTS_FOLDER)] == [0]
    assert "goodput " in faulty.stdout and "(2 attempt(s), 1 restart(s))" in faulty.stdout


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_failure_without_restarts_says_how_to_turn_them_on_and_how_to_resume(tmp_path):
    flags = ["--epochs", "1", "--checkpoint-every", "2", "--output-dir", str(tmp_path / "o")]
    result = _train_digits(*flags, env=fault_env(kill_at="0:3"))  # killed at step 3
    assert result.returncode == 1
    summary = _summary_lines(result)
    assert "first failure: rank 0/2 died from signal SIGKILL" in summary[0]
    assert result.stderr.strip().splitlines()[-1] == summary[-1]  # the summary ends the output
    assert "restarts are off (--max-restarts 0); add --max-restarts N" in summary[-1]
    resume = shlex.join(["ddpkit", *DIGITS_2_RANKS[2:], *flags, "--resume", "auto"])
    assert summary[-1].endswith(
        f"; the newest complete checkpoint is step-00000002 in {tmp_path / 'o' / 'checkpoints'}; "
        f"resume with: {resume}."
    ), summary[-1]


def test_nan_loss_stops_every_rank_naming_the_step(tmp_path):
    result = _train_digits(
        "--epochs",
        "1",
        "--lr",
        "1e9",
        "--on-nonfinite",
        "raise",
        "--output-dir",
        str(tmp_path / "o"),
    )
    assert result.returncode == 1
    assert "NonFiniteError: non-finite loss at step" in _summary_lines(result)[0]
    assert not (tmp_path / "o" / "summary.json").exists()
