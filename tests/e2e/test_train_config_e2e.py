"""The parent hands its ranks the resolved settings as a file: a 2-process ``ddpkit train`` with
``--config`` and overriding flags trains exactly as plain ``torchrun -m ddpkit train`` does with
the same settings given as flags (ranks parsing their own argv, no parent)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import run_cli

FILE = """
[run]
seed = 3
lr = 0.002
max_steps = 1

[step]
grad_accum = 1
"""
SAME_AS_FLAGS = ["--seed", "3", "--lr", "0.002", "--grad-accum", "2", "--max-steps", "3"]


@pytest.mark.slow
def test_ranks_get_the_resolved_config_and_match_plain_torchrun(tmp_path):
    pytest.importorskip("sklearn")
    config = tmp_path / "run.toml"
    config.write_text(FILE)
    common = ["--dataset", "digits", "--epochs", "1", "--progress", "off", "--log-every", "0"]
    launched = tmp_path / "launched"
    result = run_cli(
        [
            "-m",
            "ddpkit",
            "train",
            "--nproc",
            "2",
            "--config",
            str(config),
            *common,
            "--grad-accum",
            "2",
            "--max-steps",
            "3",
            "--output-dir",
            str(launched),
        ],
        timeout_s=240,
    )
    assert result.returncode == 0, result.output
    plain = tmp_path / "plain"
    result = run_cli(
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "ddpkit",
            "train",
            *common,
            *SAME_AS_FLAGS,
            "--output-dir",
            str(plain),
        ],
        timeout_s=240,
    )
    assert result.returncode == 0, result.output
    summaries = [json.loads((out / "summary.json").read_text()) for out in (launched, plain)]
    for summary in summaries:  # the file's values, the flags over them
        assert summary["world_size"] == 2 and summary["final_step"] == 3
        config_used = summary["config"]
        assert (config_used["seed"], config_used["lr"], config_used["grad_accum"]) == (3, 0.002, 2)
    assert summaries[0]["test_loss"] == summaries[1]["test_loss"]
    models = [torch.load(out / "model.pt", weights_only=True) for out in (launched, plain)]
    assert models[0].keys() == models[1].keys()
    for name in models[0]:
        assert torch.equal(models[0][name], models[1][name]), name
