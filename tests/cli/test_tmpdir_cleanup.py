"""A job leaves nothing in ``$TMPDIR``: however it ends, and without touching another job's folders.

Before: every ``ddpkit run`` / ``ddpkit train`` left torchrun's ``torchelastic_*`` log folder,
``ddpkit train`` also torch's (empty) ``torchinductor_<user>`` compile cache folder, and a stop
signal that reached the launcher before its workers started left ``ddpkit-run-*`` (and
``ddpkit-train-*``) as well. Each case runs with ``TMPDIR`` set to a fresh folder that already
holds another job's folders, named as ours are; they must survive.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import descendants, run_cli

PROBE = str(Path(__file__).parent / "scripts" / "probe.py")
ANOTHER_JOB = ("torchelastic_another", "ddpkit-run-another", "ddpkit-train-another")
RUN = ["-m", "ddpkit", "run", "-n", "2", PROBE]


@pytest.fixture
def tmpdir_env(tmp_path: Path) -> dict[str, str]:
    """``TMPDIR`` (and ``TEMP``, ``TMP``) at a fresh folder holding another job's folders."""
    folder = tmp_path / "tmp"
    for name in ANOTHER_JOB:
        (folder / name).mkdir(parents=True)
        (folder / name / "log.txt").write_text("another job's\n")
    return {"TMPDIR": str(folder), "TEMP": str(folder), "TMP": str(folder)}


def _left_behind(env: dict[str, str]) -> list[str]:
    """What is in the job's ``TMPDIR`` apart from the other job's folders (which must remain)."""
    folder = Path(env["TMPDIR"])
    for name in ANOTHER_JOB:
        assert (folder / name / "log.txt").read_text() == "another job's\n", f"{name} was touched"
    return sorted(set(os.listdir(folder)) - set(ANOTHER_JOB))


def _signalled(
    args: list[str], env: dict[str, str], ready: Callable[[], bool], sig: signal.Signals
) -> tuple[int, str]:
    """Start ``python args``, send ``sig`` to the launcher alone once ``ready()``; its exit
    status and stderr. Every process of the job is killed if anything goes wrong."""
    proc = subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not ready():
            assert proc.poll() is None, f"ended before the signal: {proc.communicate()[1]}"
            assert time.monotonic() < deadline, "not ready within 60 s"
            time.sleep(0.005)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        return proc.returncode, err
    finally:
        for pid in descendants(proc.pid):  # the workers run in sessions of their own
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=10)


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags,expected",
    [([], 0), (["--fail-rank", "1"], 1), (["--kill-rank", "1", "--steps", "50"], 1)],
    ids=["success", "rank-1-raises", "rank-1-sigkilled"],
)
def test_run_leaves_nothing_in_tmpdir(tmpdir_env, flags, expected):
    result = run_cli([*RUN, *flags], timeout_s=90, env=tmpdir_env)
    assert result.returncode == expected, result.output
    assert _left_behind(tmpdir_env) == []


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_run_stopped_by_a_signal_leaves_nothing_in_tmpdir(tmpdir_env, tmp_path, sig):
    pids = tmp_path / "pids"
    pids.mkdir()
    flags = ["--pid-dir", str(pids), "--steps", "600"]

    def running() -> bool:
        return len(list(pids.glob("rank*.pid"))) == 2

    code, err = _signalled([*RUN, *flags], tmpdir_env, running, sig)
    assert code == 128 + int(sig), err
    assert _left_behind(tmpdir_env) == []


@pytest.mark.slow
def test_run_stopped_before_its_workers_start_leaves_nothing_in_tmpdir(tmpdir_env):
    """SIGTERM as soon as the launcher made its run folder: during its checks or the rendezvous,
    before torchrun installs its own handler (the default action ended it, folders left)."""

    def started() -> bool:
        return any(name.startswith("ddpkit-run-") for name in _left_behind(tmpdir_env))

    code, err = _signalled([*RUN, "--steps", "600"], tmpdir_env, started, signal.SIGTERM)
    assert _left_behind(tmpdir_env) == [], err
    assert code == 143, err  # not -15: the launcher ended through its own code
    assert "stopped by SIGTERM" in err


@pytest.mark.slow
def test_train_leaves_nothing_in_tmpdir(tmpdir_env, mnist_dir, tmp_path):
    result = run_cli(
        [
            "-m",
            "ddpkit",
            "train",
            "--nproc",
            "2",
            "--max-steps",
            "20",
            "--data-dir",
            str(mnist_dir),
            "--output-dir",
            str(tmp_path / "out"),
        ],
        timeout_s=180,
        env=tmpdir_env,
    )
    assert result.returncode == 0, result.output
    assert (tmp_path / "out" / "summary.json").is_file()
    assert _left_behind(tmpdir_env) == []
