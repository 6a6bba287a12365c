"""Record files of ``ddpkit train`` (JSONL + CSV) across new and resumed runs; StepTimer basics."""

from __future__ import annotations

import csv
import json
import resource

import pytest
import torch

from ddpkit.app.mnist.outputs import append_record, read_records, reset_outputs
from ddpkit.env import ProcessInfo
from ddpkit.monitoring.observe import PHASES, StepTimer, peak_memory_mb
from ddpkit.runtime.process_group import Runtime


@pytest.fixture
def runtime() -> Runtime:
    return Runtime(ProcessInfo())


def _csv_rows(path) -> list[dict]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def _fill(out) -> None:
    for epoch in (1, 2, 3):
        append_record(
            out, "metrics", {"epoch": epoch, "train_loss": 1.0 / epoch, "step": 4 * epoch}
        )
    for step in range(2, 13, 2):
        append_record(out, "steps", {"step": step, "loss": float("nan") if step == 6 else 0.5})
    (out / "tensorboard").mkdir()
    (out / "checkpoints").mkdir()


def test_resume_keeps_completed_records_in_jsonl_and_csv(tmp_path, runtime):
    _fill(tmp_path)
    assert _csv_rows(tmp_path / "steps.csv")[2] == {"step": "6", "loss": ""}  # NaN: empty cell
    assert read_records(tmp_path / "steps.jsonl")[2] == {"step": 6, "loss": None}
    reset_outputs(tmp_path, runtime, completed_epochs=2, completed_step=9)
    assert [r["epoch"] for r in read_records(tmp_path / "metrics.jsonl")] == [1, 2]
    assert [r["epoch"] for r in _csv_rows(tmp_path / "metrics.csv")] == ["1", "2"]
    assert [r["step"] for r in read_records(tmp_path / "steps.jsonl")] == [2, 4, 6, 8]
    assert [r["step"] for r in _csv_rows(tmp_path / "steps.csv")] == ["2", "4", "6", "8"]
    assert (tmp_path / "tensorboard").exists() and (tmp_path / "checkpoints").exists()
    append_record(tmp_path, "steps", {"step": 10, "loss": 0.25})  # the resumed run goes on
    assert _csv_rows(tmp_path / "steps.csv")[-1] == {"step": "10", "loss": "0.25"}
    assert (tmp_path / "steps.csv").read_text().count("step,loss") == 1  # one header


def test_a_record_with_new_keys_widens_the_csv_without_dropping_values(tmp_path):
    # a run resumed with --step-timing on after off: later epoch records carry more keys
    append_record(tmp_path, "metrics", {"epoch": 1, "train_loss": 0.5})
    append_record(tmp_path, "metrics", {"epoch": 2, "train_loss": 0.4, "forward_s_per_step": 0.1})
    append_record(tmp_path, "metrics", {"epoch": 3, "train_loss": 0.3, "forward_s_per_step": 0.2})
    append_record(tmp_path, "metrics", {"epoch": 4, "train_loss": 0.2})
    rows = _csv_rows(tmp_path / "metrics.csv")
    assert list(rows[0]) == ["epoch", "train_loss", "forward_s_per_step"]
    assert [r["forward_s_per_step"] for r in rows] == ["", "0.1", "0.2", ""]
    assert [r["epoch"] for r in rows] == ["1", "2", "3", "4"]
    assert len(read_records(tmp_path / "metrics.jsonl")) == 4
    assert not list(tmp_path.glob(".*"))  # no temporary file left


def test_new_run_removes_every_record_and_event_file(tmp_path, runtime):
    _fill(tmp_path)
    reset_outputs(tmp_path, runtime, completed_epochs=None)
    for name in ("metrics.jsonl", "metrics.csv", "steps.jsonl", "steps.csv", "tensorboard"):
        assert not (tmp_path / name).exists(), name


def test_malformed_record_file_is_a_value_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match="every line must be a JSON object"):
        read_records(tmp_path / "metrics.jsonl")
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 1\n')
    with pytest.raises(json.JSONDecodeError):
        read_records(tmp_path / "metrics.jsonl")


def test_step_timer_at_world_size_1(runtime):
    timer = StepTimer(runtime)
    with timer.phase("forward"):
        torch.ones(10).sum()
    assert timer.end_step(num_samples_global=8)["forward"] > 0  # the step's own split
    with pytest.raises(KeyError, match="unknown step phase: name='backward'"):
        with timer.phase("backward"):
            pass
    forward_s = timer.seconds["forward"]
    summary = timer.epoch_summary()
    assert summary["forward_s"] == forward_s > 0 and summary["forward_s_per_step"] == forward_s
    assert summary["step_s_per_step"] == sum(summary[f"{p}_s_per_step"] for p in PHASES)
    assert timer.num_steps == 0 and timer.seconds["forward"] == 0.0  # reset for the next epoch
    # peak RSS in MiB: ru_maxrss is KiB on Linux
    assert summary["peak_memory_mb"] == pytest.approx(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, rel=0.05
    )
    assert peak_memory_mb(runtime.device) >= summary["peak_memory_mb"]
    off = StepTimer(runtime, enabled=False)
    with off.phase("forward"):
        pass
    assert off.epoch_summary().keys() == {"peak_memory_mb"}
