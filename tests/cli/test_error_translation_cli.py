"""Failures caused through the CLI: the summary carries the hint; NaN points at the guard."""

from __future__ import annotations

import textwrap

import pytest

from tests.helpers import run_cli

DDP_BEFORE_INIT = """
import torch
from torch.nn.parallel import DistributedDataParallel
model = DistributedDataParallel(torch.nn.Linear(2, 2))   # forgot to initialise
"""


@pytest.mark.slow
def test_launcher_summary_carries_the_hint(tmp_path):
    script = tmp_path / "no_init.py"
    script.write_text(textwrap.dedent(DDP_BEFORE_INIT))
    result = run_cli(["-m", "ddpkit", "run", "-n", "2", str(script)], timeout_s=120)
    assert result.returncode == 1
    assert "ddpkit run: hint: torch.distributed was used before the process group" in result.output
    assert "ddpkit hint: torch.distributed was used before" in result.output  # under the traceback


@pytest.mark.slow
def test_nan_loss_points_at_the_guard(tmp_path):
    result = run_cli(
        ["-m", "ddpkit", "train", "--dataset", "digits", "--nproc", "2", "--optimizer", "sgd",
         "--lr", "1e5", "--max-steps", "10", "--output-dir", str(tmp_path / "run")],
        timeout_s=180,
    )  # fmt: skip
    assert result.returncode == 1, result.output
    assert "mean train loss over all ranks is nan" in result.output
    assert "--on-nonfinite raise" in result.output
    assert "Traceback" not in result.output  # ddpkit's own error: one line, no traceback
    assert not (tmp_path / "run" / "summary.json").exists()
