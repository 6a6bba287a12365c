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


ATTRIBUTE_THROUGH_WRAPPER = """
import torch
import ddpkit
with ddpkit.init_runtime() as rt:
    model = ddpkit.wrap_model(torch.nn.Linear(2, 2), rt)
    print(model.in_features)   # works at 1 process, where wrap_model returns the module itself
"""


def test_hint_is_printed_once_per_rank_under_ddpkit_run(tmp_path):
    # the Runtime adds the hint as a note (for plain torchrun); the bootstrap must not repeat it
    script = tmp_path / "attr.py"
    script.write_text(textwrap.dedent(ATTRIBUTE_THROUGH_WRAPPER))
    result = run_cli(["-m", "ddpkit", "run", "-n", "2", str(script)], timeout_s=120)
    assert result.returncode == 1
    assert "'DistributedDataParallel' object has no attribute 'in_features'" in result.output
    assert "ddpkit run: hint: DDP wraps your model" in result.output
    assert "ddpkit.unwrap_model(model).in_features" in result.output
    for rank in (0, 1):
        assert result.output.count(f"[rank {rank}/2] ddpkit hint: ") <= 1, result.output
    assert result.output.count("] ddpkit hint: ") >= 1, result.output
