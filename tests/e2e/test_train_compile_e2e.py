"""``ddpkit train --compile`` end to end: a compiled job resumed from an eager job's checkpoint
ends with the eager job's parameters, and its own checkpoints carry the plain keys.

``--compile-backend aot_eager``: the graphs, DDPOptimizer's split and the gradient check are
those of the default; inductor's code generation (~25 s more per rank here) is left out.
"""

from __future__ import annotations

import json

import pytest
import torch

from ddpkit.app.mnist.model import DigitsCNN
from tests.helpers import run_cli
from tests.mnist_job import train_in_process

COMMON = ["-m", "ddpkit", "train", "--dataset", "digits", "--nproc", "2", "--epochs", "2"]
COMMON += ["--max-steps", "4", "--checkpoint-every", "2"]  # 8 optimizer steps in all


def _model_keys(checkpoint) -> list[str]:
    return list(torch.load(checkpoint / "state.pt", weights_only=False)["state"]["model"])


def test_compiled_job_resumes_an_eager_checkpoint_to_the_same_parameters(tmp_path):
    pytest.importorskip("sklearn")
    # the eager run checks the job only: in-process (tests/mnist_job.py), no launcher
    eager = train_in_process([*COMMON[3:], "--output-dir", str(tmp_path / "eager")], nproc=2)
    assert eager.summary["final_step"] == 8, eager.summary
    halfway = tmp_path / "eager" / "checkpoints" / "step-00000004"
    compiled = run_cli(
        [
            *COMMON,
            "--compile",
            "--compile-backend",
            "aot_eager",
            "--resume",
            str(halfway),
            "--output-dir",
            str(tmp_path / "compiled"),
        ],
        timeout_s=240,
    )
    assert compiled.returncode == 0, compiled.output
    assert "torch.compile backend aot_eager" in compiled.stdout
    assert "gradients compared across ranks before the first 3 optimizer steps" in (compiled.stdout)
    assert "Profiler record function" not in compiled.output  # dynamo's DDP noise dropped
    plain_keys = list(DigitsCNN().state_dict())
    assert _model_keys(halfway) == plain_keys
    assert _model_keys(tmp_path / "compiled" / "checkpoints" / "step-00000008") == plain_keys
    models = [
        torch.load(tmp_path / d / "model.pt", weights_only=True) for d in ("eager", "compiled")
    ]
    assert list(models[1]) == plain_keys
    assert all(torch.equal(models[0][k], models[1][k]) for k in plain_keys)
    summary = json.loads((tmp_path / "compiled" / "summary.json").read_text())
    assert summary["final_step"] == 8 and summary["config"]["compile"] is True


def test_fsdp_job_with_compile_compiles_its_blocks(tmp_path):
    # --strategy fsdp --compile used to train eager without a word (the flag was dropped)
    pytest.importorskip("sklearn")
    flags = [*COMMON[3:], "--strategy", "fsdp", "--compile", "--compile-backend", "aot_eager"]
    run = train_in_process([*flags, "--output-dir", str(tmp_path / "fsdp")], nproc=2)
    assert run.summary["final_step"] == 8, run.summary
    assert "compiled in place with torch.compile(backend='aot_eager')" in run.stdout, run.output
