"""Failures caused through the CLI: the summary carries the hint; NaN points at the guard."""

from __future__ import annotations

import re
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
        [
            "-m",
            "ddpkit",
            "train",
            "--dataset",
            "digits",
            "--nproc",
            "2",
            "--optimizer",
            "sgd",
            "--lr",
            "1e5",
            "--max-steps",
            "10",
            "--output-dir",
            str(tmp_path / "run"),
        ],
        timeout_s=180,
    )
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


@pytest.mark.slow
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


SIZE_MISMATCH = """
import torch, ddpkit

with ddpkit.init_runtime() as rt:
    ddpkit.all_reduce(torch.ones(4 if rt.rank == 0 else 8), rt)
"""


@pytest.mark.slow
def test_gloo_collective_mismatch_is_named_not_blamed_on_the_network(tmp_path):
    # plain torch: gloo's terminate message on one rank, "Connection reset by peer" on the
    # other, torchrun's "SIGABRT" root cause; ddpkit said "a peer stopped answering ... the
    # network between nodes went down" and "died from signal SIGABRT without a Python exception"
    script = tmp_path / "mismatch.py"
    script.write_text(textwrap.dedent(SIZE_MISMATCH))
    result = run_cli(["-m", "ddpkit", "run", "-n", "2", str(script)], timeout_s=120)
    out = result.output
    assert result.returncode == 1, out
    summary = [line for line in out.splitlines() if line.startswith("ddpkit run:")]
    assert summary[0].startswith("ddpkit run: first failure: rank "), out
    assert "aborted (SIGABRT): gloo found a collective mismatch: it received " in summary[0]
    assert summary[0].endswith(f" in all_reduce called at {script}:5."), out
    hint = next(line for line in summary if line.startswith("ddpkit run: hint:"))
    assert "the ranks' collectives do not match: rank " in hint
    # the aborted rank's op, line and gloo's byte counts come from its own stderr: always there
    assert re.search(
        rf"rank [01] all_reduce at {script}:5 \(expected [48] bytes, received [48]\)", hint
    ), hint
    # the surviving rank's dtype and shape come from its own failure record, which it writes
    # only if torchrun's SIGTERM (sent the moment the aborted rank dies) has not reached it yet
    if "a peer's process ended during it" in out:  # the surviving rank's own error
        assert re.search(rf"rank [01] all_reduce of float32 \([48],\) at {script}:5", hint), hint
    assert "network" not in "\n".join(summary) and "without a Python exception" not in out
    assert summary[-1].endswith("a restart would fail the same way.")
