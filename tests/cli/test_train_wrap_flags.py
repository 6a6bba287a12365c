"""``ddpkit train``'s strategy and gradient-communication flags: listed with units, bad
combinations refused in one line (exit 2, nothing written), and the byte counts reported."""

from __future__ import annotations

import json

import pytest
import torch

from ddpkit.app.mnist.model import DigitsCNN
from ddpkit.cli import main
from tests.helpers import run_main
from tests.mnist_job import train_in_process

NUM_CUDA = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize(
    "extra,expected",
    [
        (["--grad-compression", "int8"], "argument --grad-compression: invalid choice: 'int8'"),
        (["--strategy", "hsdp"], "argument --strategy: invalid choice: 'hsdp'"),
        (
            ["--strategy", "fsdp", "--grad-compression", "fp16", "--join"],
            "grad_compression='fp16', join=True with strategy='fsdp'. These configure DDP's",
        ),
        (
            ["--strategy", "fsdp", "--precision", "16-mixed"],
            "precision='16-mixed' with strategy='fsdp'",
        ),
        (
            ["--strategy", "fsdp", "--nproc", "1"],
            "strategy='fsdp' with world_size=1. It needs 2 or more processes",
        ),
        (
            ["--strategy", "zero1", "--sync-every", "2"],
            "sync_every=2 with strategy='zero1'. Local SGD averages whole replicas",
        ),
        (
            ["--async-checkpoint"],
            "async_checkpoint=True with strategy='ddp'. Only sharded checkpoints",
        ),
        (
            ["--strategy", "zero1", "--async-checkpoint"],  # nothing would be written async
            "async_checkpoint=True with checkpoint_every=0. Only the periodic checkpoints",
        ),
        (
            ["--reshard-after-forward", "off"],
            "reshard_after_forward=False with strategy='ddp'. These configure FSDP's fully_shard",
        ),
        (["--bucket-cap-mb", "0"], "bucket_cap_mb=0.0 must be a finite number > 0"),
        (["--powersgd-start-step", "1"], "powersgd_start_step=1 must be >= 2"),
        (["--sync-every", "0"], "sync_every=0 must be >= 1"),
        (
            ["--sync-every", "4", "--check-replicas-every", "6"],
            "check_replicas_every=6 with sync_every=4. It must be a multiple of sync_every",
        ),
        (
            ["--sync-every", "4", "--checkpoint-every", "10"],
            "checkpoint_every=10 with sync_every=4. It must be a multiple of sync_every",
        ),
        (["--sync-every", "2", "--grad-compression", "fp16"], "Local SGD sends no gradients"),
        (["--sync-every", "2", "--join"], "sync_every=2 with join=True. Join cannot stand in"),
        (["--sync-every", "2", "--static-graph"], "sync_every=2 with static_graph=True. DDP fails"),
        (
            ["--strategy", "single", "--nproc", "2"],
            "strategy='single' with world_size=2. It runs in one process",
        ),
        (
            ["--strategy", "ddp", "--nproc", "1"],
            "strategy='ddp' with world_size=1. It needs 2 or more processes",
        ),
        (
            ["--nproc", "1", "--grad-compression", "fp16", "--sync-batchnorm"],
            "grad_compression='fp16', sync_batchnorm=True with strategy='single' "
            "(world_size=1). These configure DDP's gradient sync, and strategy 'single' has none",
        ),
        (
            ["--compile", "--strategy", "dp", "--nproc", "1"],
            "compile=True with strategy='dp'. DataParallel replicates the module onto every GPU "
            "at each forward, which torch.compile does not support",
        ),
        (["--compile", "--bucket-cap-mb", "0.5"], "compile=True with bucket_cap_mb=0.5. torch"),
        (["--compile-backend", "eager"], "compile_backend='eager' without compile=True"),
        (["--compile-backend", "tvm"], "argument --compile-backend: invalid choice: 'tvm'"),
        pytest.param(
            ["--strategy", "dp"],
            f"strategy='dp' needs 2 or more CUDA devices: found {NUM_CUDA}",
            marks=pytest.mark.skipif(NUM_CUDA >= 2, reason="2 CUDA devices: dp is allowed"),
        ),
    ],
)
def test_bad_wrap_flags_are_one_line_exit_2(tmp_path, capsys, extra, expected):
    pytest.importorskip("sklearn")
    out = tmp_path / "out"
    argv = ["train", "--dataset", "digits", "--output-dir", str(out), *extra]
    code, err = run_main(argv, capsys)
    assert code == 2
    assert expected in err
    assert len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_help_lists_the_flags_with_units(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for snippet in (
        "--strategy {auto,single,ddp,dp,zero1,fsdp}",
        "--reshard-after-forward {on,off}",
        "--bucket-cap-mb MIB DDP gradient bucket size in MiB",
        "--grad-as-bucket-view",
        "--grad-compression {none,fp16,bf16,powersgd}",
        "--powersgd-rank R",
        "--powersgd-start-step STEPS",
        "--sync-every H",
        "--sync-batchnorm",
        "--compile torch.compile the wrapped model (after DDP, in place",
        "--compile-backend NAME torch.compile backend with --compile: inductor (default",
    ):
        assert snippet in text, snippet


@pytest.mark.slow
def test_local_sgd_job_reports_averaging_bytes_per_step(tmp_path):
    """8 steps with averaging every 4: two rounds of all parameters, no gradient bytes.

    The job's counts, not the command line: in-process (tests/mnist_job.py), no launcher."""
    pytest.importorskip("sklearn")
    out = tmp_path / "run"
    flags = ["--max-steps", "8", "--sync-every", "4", "--check-replicas-every", "4"]
    result = train_in_process(
        ["--dataset", "digits", "--epochs", "1", "--output-dir", str(out), *flags], nproc=2
    )
    assert result.summary["world_size"] == 2, result.summary
    assert "local SGD averaging every 4 steps" in result.stdout
    param_bytes = sum(p.numel() * p.element_size() for p in DigitsCNN().parameters())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_step"] == 8
    assert summary["comm_bytes_per_step"] == 2 * param_bytes / 8
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert record["comm_bytes_per_step"] == summary["comm_bytes_per_step"]
    assert summary["config"]["sync_every"] == 4


def test_resume_with_another_local_sgd_period_is_refused(tmp_path, capsys):
    from ddpkit.app.mnist.config import TrainConfig, resume_settings
    from ddpkit.checkpoint.io import write_checkpoint

    out = tmp_path / "run"
    settings = {**resume_settings(TrainConfig(sync_every=2)), "dataset": "digits"}
    write_checkpoint(out / "checkpoints", 4, {"step": 4}, {"world_size": 2, "extra": settings})
    argv = ["train", "--dataset", "digits", "--nproc", "2", "--sync-every", "4"]
    code, err = run_main([*argv, "--resume", "auto", "--output-dir", str(out)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "sync_every 2 (this job: 4)" in err
