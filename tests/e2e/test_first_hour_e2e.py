"""A new user's first hour (issue 16): the offline first run, Ctrl-C, relayed lines.

Each test runs ``ddpkit train`` as a user would, in a subprocess with a hard timeout.
"""

from __future__ import annotations

import json
import re
import shlex
import time
from pathlib import Path

import pytest

from tests.helpers import run_cli

README = Path(__file__).resolve().parents[2] / "README.md"
DIGITS_2_RANKS = ["-m", "ddpkit", "train", "--dataset", "digits", "--nproc", "2"]


def readme_main_command() -> list[str]:
    """The ``ddpkit`` arguments of the README's main command (``... && .venv/bin/ddpkit ARGS``)."""
    found = re.findall(
        r"^bash scripts/setup\.sh && \.venv/bin/ddpkit (.+)$", README.read_text(), re.M
    )
    assert len(found) == 1, "README.md must hold the main command once"
    return shlex.split(found[0])


def test_the_readme_main_command_offline_reaches_095_in_seconds(tmp_path):
    # the offline first run, as typed from the README: ddpkit picks the digits model and epochs
    pytest.importorskip("sklearn")
    offline = {
        "DDPKIT_CACHE_DIR": str(tmp_path / "cache"),
        "DDPKIT_MNIST_MIRRORS": "http://127.0.0.1:1/",  # loopback, nothing listening
    }
    start = time.monotonic()
    result = run_cli(
        ["-m", "ddpkit", *readme_main_command()], env=offline, cwd=str(tmp_path), timeout_s=240
    )
    wall_s = time.monotonic() - start
    assert result.returncode == 0, result.output
    assert result.stdout.count("MNIST unavailable") == 1
    summary = json.loads((tmp_path / "runs" / "mnist" / "summary.json").read_text())
    assert summary["dataset"] == "digits" and summary["test_samples"] == 360
    assert summary["test_accuracy"] >= 0.95, (summary["test_accuracy"], wall_s)
    # about the time of the 1-epoch MNIST-CNN run it replaces (12 s on 2 busy cores)
    assert wall_s < 90, wall_s


def test_offline_fallback_says_model_and_epochs_in_its_one_line(tmp_path):
    pytest.importorskip("sklearn")
    offline = {
        "DDPKIT_CACHE_DIR": str(tmp_path / "cache"),
        "DDPKIT_MNIST_MIRRORS": "http://127.0.0.1:1/",  # loopback, nothing listening
    }
    common = ["-m", "ddpkit", "train", "--nproc", "2", "--max-steps", "2"]
    result = run_cli([*common, "--output-dir", str(tmp_path / "a")], env=offline, timeout_s=180)
    assert result.returncode == 0, result.output
    (note,) = [line for line in result.stdout.splitlines() if "MNIST unavailable" in line]
    assert "digits-sized CNN" in note and "20 epochs" in note, note
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["epochs"] == 20
    # an explicit --epochs is the user's: kept, and said so
    explicit = [*common, "--epochs", "2", "--output-dir", str(tmp_path / "b")]
    result = run_cli(explicit, env=offline, timeout_s=180)
    assert result.returncode == 0, result.output
    (note,) = [line for line in result.stdout.splitlines() if "MNIST unavailable" in line]
    assert "for 2 epochs (your --epochs; without it 20 epochs, which reach" in note, note
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["epochs"] == 2


UNFINISHED_LINE = """
import os, sys, time
from pathlib import Path

rank = int(os.environ["RANK"])
if rank == 0:
    os.write(2, b"rank 0 all-reduced")  # no newline, and the process ends
    sys.exit(0)
# rank 1 waits until rank 0's relay has finished (it writes the tail file last), then writes
tail = Path(os.environ["DDPKIT_RUN_DIR"]) / "stderr-r0-rank0.txt"
deadline = time.monotonic() + 60
while not tail.exists() and time.monotonic() < deadline:
    time.sleep(0.02)
os.write(2, b"[rank 1/2] Traceback\\n")
"""


def test_relayed_lines_never_join_even_without_a_final_newline(tmp_path):
    # the README says two ranks' lines never mix; a rank's last line without "\\n" did
    script = tmp_path / "unfinished.py"
    script.write_text(UNFINISHED_LINE)
    result = run_cli(["-m", "ddpkit", "run", "-n", "2", str(script)], timeout_s=120)
    assert result.returncode == 0, result.output
    lines = result.stderr.splitlines()
    assert "rank 0 all-reduced" in lines and "[rank 1/2] Traceback" in lines, result.stderr


def _wait_for_step(path, step: int, proc, timeout_s: float = 120) -> None:
    """Poll ``steps.jsonl`` until a record of ``step`` or later is there (the job is running)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the job ended before the interrupt"
        lines = path.read_text().splitlines() if path.exists() else []
        if any(json.loads(line)["step"] >= step for line in lines if line.endswith("}")):
            return
        time.sleep(0.05)
    pytest.fail(f"no step {step} record in {path} within {timeout_s} s")


def test_ctrl_c_is_one_line_naming_the_step_the_checkpoint_and_the_resume(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from tests.helpers import descendants, pid_alive

    pytest.importorskip("sklearn")
    out = tmp_path / "run"
    argv = [*DIGITS_2_RANKS, "--epochs", "50", "--checkpoint-every", "2", "--log-every", "1"]
    with open(tmp_path / "stdout", "w+") as stdout, open(tmp_path / "stderr", "w+") as stderr:
        proc = subprocess.Popen(
            [sys.executable, *argv, "--output-dir", str(out)],
            stdout=stdout,
            stderr=stderr,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,  # its own process group, as a terminal's foreground job
        )
        try:
            _wait_for_step(out / "steps.jsonl", 3, proc)  # step 2's checkpoint is complete
            started = descendants(proc.pid)
            os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        stdout.seek(0)
        stderr.seek(0)
        output, errors = stdout.read(), stderr.read()
    assert code == 130, output + errors
    assert "Traceback" not in output + errors, errors
    lines = errors.strip().splitlines()
    assert len(lines) == 1, errors
    (line,) = lines
    assert line.startswith("ddpkit train: interrupted (Ctrl-C) after step "), line
    step = int(line.split(" after step ")[1].split()[0])
    # #14: the checkpoint is at the step where it stopped, not the last periodic one
    assert f"saved: checkpoint step-{step:08d} in" in line and line.endswith(
        f"--output-dir {out} --resume auto"
    ), line
    assert not [pid for pid in started if pid_alive(pid)], "processes outlived the job"
