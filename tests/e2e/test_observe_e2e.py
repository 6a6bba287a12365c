"""Watching ``ddpkit train``: metrics/steps JSONL and CSV, TensorBoard, progress bar, plots.

One killed-and-restarted 2-rank job gives the records of a resumed run (kept, never doubled),
the TensorBoard events (stale ones purged) and the folder ``ddpkit plot`` draws; the progress
bar is checked under a pseudo-terminal and with a pipe.
"""

from __future__ import annotations

import csv
import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time

import pytest

from tests.helpers import fault_env, run_cli, run_main

DIGITS_2_RANKS = ["-m", "ddpkit", "train", "--dataset", "digits", "--nproc", "2"]
# 12 optimizer steps per epoch (719 samples per rank, batch 64), 24 in 2 epochs
STEPS_PER_EPOCH = 12
BAR = re.compile(
    r"\d+%\|.*\| \d+/\d+ \[[\d:]+<[\d:?]+, +[\d.?]+ samples/s\]"
)  # tqdm: ETA and samples/s


def _jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _csv_matches(jsonl: list[dict], path) -> None:
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == len(jsonl)
    for row, record in zip(rows, jsonl, strict=True):
        assert list(row) == list(record)
        for key, value in record.items():
            if isinstance(value, float):
                assert float(row[key]) == value, key  # repr round-trips floats
            else:
                assert row[key] == ("" if value is None else str(value)), key


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    pytest.importorskip("sklearn")
    out = tmp_path_factory.mktemp("observe") / "run"
    # checkpoints at 8 and 16; rank 1 dies at step 23 after the step-20 record was written;
    # the restart resumes at 16 (mid epoch 2) and must drop that record and write it again
    result = run_cli(
        [
            *DIGITS_2_RANKS,
            "--epochs",
            "2",
            "--log-every",
            "5",
            "--checkpoint-every",
            "8",
            "--max-restarts",
            "1",
            "--output-dir",
            str(out),
        ],
        env=fault_env(kill_at="1:23"),
        timeout_s=300,
    )
    assert result.returncode == 0, result.output
    assert "step-00000016 (step 16)" in result.stdout, result.output
    return out, result


def test_resumed_run_keeps_records_once_in_jsonl_and_csv(resumed_run):
    out, result = resumed_run
    epochs, steps = _jsonl(out / "metrics.jsonl"), _jsonl(out / "steps.jsonl")
    assert [r["epoch"] for r in epochs] == [1, 2]
    assert [r["step"] for r in epochs] == [STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH]
    assert [r["step"] for r in steps] == [5, 10, 15, 20]  # one per --log-every, none doubled
    assert [r["epoch"] for r in steps] == [1, 1, 2, 2]
    for record in epochs:
        parts = [
            record[f"{p}_s_per_step"]
            for p in ("data_wait", "forward", "backward_comm", "optimizer")
        ]
        assert all(v > 0 for v in parts[1:]) and parts[0] >= 0, record
        assert abs(sum(parts) - record["step_s_per_step"]) < 1e-9
        assert record["step_s_per_step"] < record["epoch_s"]
        assert record["peak_memory_mb"] > 10 and record["samples_per_s"] > 0
    for record in steps:
        assert 0 < record["loss"] < 5 and record["samples_per_s"] > 0 and record["lr"] > 0
    _csv_matches(epochs, out / "metrics.csv")
    _csv_matches(steps, out / "steps.csv")
    assert "%|" not in result.output  # piped: no progress bar at all


def test_tensorboard_has_the_scalars_once_per_step(resumed_run):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = resumed_run
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = {
        "step/loss",
        "step/samples_per_s",
        "step/lr",
        "epoch/train_loss",
        "epoch/test_accuracy",
        "epoch/samples_per_s",
        "epoch/peak_memory_mb",
        "step_time/forward_s_per_step",
        "step_time/data_wait_s_per_step",
        "step_time/backward_comm_s_per_step",
        "step_time/optimizer_s_per_step",
    }
    assert expected <= tags, tags
    # the interrupted attempt's step-20 event is purged by the resumed writer
    assert [e.step for e in events.Scalars("step/loss")] == [5, 10, 15, 20]
    assert [e.step for e in events.Scalars("epoch/test_accuracy")] == [12, 24]
    accuracy = [e.value for e in events.Scalars("epoch/test_accuracy")]
    assert accuracy == pytest.approx([r["test_accuracy"] for r in _jsonl(out / "metrics.jsonl")])


def test_plot_writes_four_pngs(resumed_run, tmp_path, capsys):
    from matplotlib import image

    out, _ = resumed_run
    code, err = run_main(["plot", str(out), "--out", str(tmp_path / "plots")], capsys)
    assert code == 0, err
    for name in ("loss.png", "accuracy.png", "throughput.png", "step_time.png"):
        path = tmp_path / "plots" / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
        assert image.imread(path).shape == (450, 700, 4)  # 7 x 4.5 in at 100 dpi, RGBA


def test_plot_refuses_bad_folders(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text('{"epoch": 1,\n')
    (tmp_path / "nometrics").mkdir()
    cases = {
        "missing": "no such output folder",
        "nometrics": "no epoch records",
        "empty": "no epoch records",
        "bad": "cannot read",
    }
    for name, expected in cases.items():
        code, err = run_main(["plot", str(tmp_path / name)], capsys)
        assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, err
    # a run stopped inside epoch 1: step records, no epoch record yet
    (tmp_path / "nometrics" / "steps.jsonl").write_text('{"step": 5}\n{"step": 10}\n')
    code, err = run_main(["plot", str(tmp_path / "nometrics")], capsys)
    assert code == 2 and "steps.jsonl holds 2 step record(s), up to step 10" in err, err
    assert "plot again after epoch 1 ends" in err and len(err.strip().splitlines()) == 1, err


def test_plot_into_an_unwritable_place_is_one_line_exit_2(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    record = {
        "epoch": 1,
        "train_loss": 1.0,
        "test_loss": 0.9,
        "test_accuracy": 0.7,
        "samples_per_s": 500.0,
        "step": 10,
    }
    (run / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    (tmp_path / "plots" / "loss.png").mkdir(parents=True)  # what a read-only file also gives
    code, err = run_main(["plot", str(run), "--out", str(tmp_path / "plots")], capsys)
    assert code == 2, err
    assert f"cannot write the plot: path={tmp_path / 'plots' / 'loss.png'}" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def _run_in_pty(args: list[str], timeout_s: float) -> tuple[int, str]:
    """Run ``python <args>`` with stdin/stdout/stderr on a pseudo-terminal; all its output."""
    master, slave = pty.openpty()
    # a fresh pty is 0 x 0: tqdm would draw a bar of no width; give it 40 rows x 120 columns
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, *args],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        start_new_session=True,
    )
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every holder of the terminal closed it
                    break
                if not data:
                    break
                chunks.append(data)
        else:
            os.killpg(proc.pid, 9)
            pytest.fail(f"{args} timed out after {timeout_s} s")
        return proc.wait(timeout=30), b"".join(chunks).decode(errors="replace")
    finally:
        os.close(master)


def test_progress_bar_on_a_terminal_from_rank_0_only(tmp_path):
    pytest.importorskip("sklearn")
    code, output = _run_in_pty(
        [*DIGITS_2_RANKS, "--epochs", "2", "--output-dir", str(tmp_path / "tty")], 240
    )
    assert code == 0, output
    assert BAR.search(output), output
    # tqdm draws each bar's 0% state once when it opens: one bar per epoch, rank 0 only
    assert len(re.findall(r"epoch \d/2:\s+0%\|", output)) == 2, output
    assert "epoch 2/2  train_loss" in output  # the log lines stay


def test_progress_on_when_piped_and_off_on_a_terminal(tmp_path):
    pytest.importorskip("sklearn")
    common = [*DIGITS_2_RANKS, "--epochs", "1", "--max-steps", "3"]
    piped = run_cli([*common, "--progress", "on", "--output-dir", str(tmp_path / "p")], 180)
    assert piped.returncode == 0, piped.output
    assert BAR.search(piped.stderr) and len(re.findall(r"epoch 1/1:\s+0%\|", piped.stderr)) == 1
    off = ["--progress", "off", "--step-timing", "off", "--log-every", "0"]
    code, output = _run_in_pty([*common, *off, "--output-dir", str(tmp_path / "t")], 180)
    assert code == 0, output
    assert "%|" not in output and "epoch 1/1  train_loss" in output
    # no timing: no phase keys (never zeros posing as times), peak memory still there
    (record,) = _jsonl(tmp_path / "t" / "metrics.jsonl")
    assert not any(key.endswith("_s_per_step") for key in record) and record["peak_memory_mb"] > 0
    assert not (tmp_path / "t" / "steps.jsonl").exists()  # --log-every 0


def test_bad_observe_flags_exit_2(tmp_path, capsys):
    code, err = run_main(
        ["train", "--log-every", "-1", "--output-dir", str(tmp_path / "o")], capsys
    )
    assert code == 2 and "log_every=-1 must be >= 0" in err
    code, err = run_main(["train", "--progress", "maybe"], capsys)
    assert code == 2 and "argument --progress: invalid choice" in err


def test_without_tensorboard_one_info_line(tmp_path, monkeypatch, caplog):
    import logging

    from ddpkit.app.mnist.monitor import open_tensorboard
    from ddpkit.env import ProcessInfo
    from ddpkit.runtime.process_group import Runtime

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard -> ImportError
    runtime = Runtime(ProcessInfo())
    with caplog.at_level(logging.INFO, logger="ddpkit"):
        assert open_tensorboard(tmp_path, runtime, "auto", None) is None
        assert open_tensorboard(tmp_path, runtime, "off", None) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "pip install 'ddpkit[tensorboard]'" in lines[0], lines
    assert not (tmp_path / "tensorboard").exists()
