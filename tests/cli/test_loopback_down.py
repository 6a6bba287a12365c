"""Loopback down (issue 16 §2): a fresh network namespace (``unshare -rn``) starts with ``lo``
down. Every command must fail in seconds with one line that says so and how to fix it, instead
of retrying for the whole init timeout (plain torchrun: 300 s of C++ retry warnings).

Every process of these tests runs inside its own namespace; nothing outside is contacted.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

FIX = "the loopback interface is down"


def _unshare_works() -> str | None:
    if shutil.which("unshare") is None:
        return "no unshare command on this machine"
    probe = subprocess.run(["unshare", "-rn", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"unshare -rn is not allowed here: {probe.stderr.strip()[:200]}"
    return None


pytestmark = pytest.mark.skipif(_unshare_works() is not None, reason=str(_unshare_works()))


def _in_fresh_namespace(args: list[str], timeout_s: float = 90) -> tuple[int, str, str, float]:
    """Run ``python args`` in a new user+network namespace (lo down); returns code, out, err, s."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    try:
        proc = subprocess.run(
            ["unshare", "-rn", sys.executable, *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{args} still running after {timeout_s} s (lo down):\n{exc.stderr}")
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start


@pytest.mark.slow
def test_train_with_loopback_down_fails_in_seconds_with_one_line(tmp_path):
    pytest.importorskip("sklearn")
    args = ["-m", "ddpkit", "train", "--nproc", "2", "--dataset", "digits"]
    code, _, err, took_s = _in_fresh_namespace([*args, "--output-dir", str(tmp_path / "o")])
    assert code == 1, err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"ddpkit train: error: {FIX}") and "ip link set lo up" in err, err
    assert took_s < 60, took_s


@pytest.mark.slow
def test_run_with_loopback_down_fails_in_seconds_with_one_line(tmp_path):
    script = tmp_path / "noop.py"
    script.write_text("import ddpkit\nwith ddpkit.init_runtime() as rt:\n    pass\n")
    code, _, err, took_s = _in_fresh_namespace(["-m", "ddpkit", "run", "-n", "2", str(script)])
    assert code == 1, err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"ddpkit run: error: {FIX}") and "ip link set lo up" in err, err


@pytest.mark.slow
def test_init_runtime_with_loopback_down_says_so(tmp_path):
    # a hand-set rendezvous (python train.py with MASTER_ADDR/PORT): checked before the store
    script = tmp_path / "rank0.py"
    script.write_text(
        "import os, ddpkit\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='29999', RANK='0',"
        " WORLD_SIZE='2', LOCAL_RANK='0', LOCAL_WORLD_SIZE='2')\n"
        "try:\n"
        "    ddpkit.init_runtime(init_timeout_s=300)\n"
        "except ddpkit.DistributedError as exc:\n"
        "    print(exc)\n"
    )
    code, out, err, took_s = _in_fresh_namespace([str(script)])
    assert code == 0, err
    assert out.startswith(FIX) and "127.0.0.1" in out and "ip link set lo up" in out, out
    assert took_s < 60, took_s


@pytest.mark.slow
def test_doctor_with_loopback_down_names_the_fix():
    code, out, err, _ = _in_fresh_namespace(["-m", "ddpkit", "doctor"])
    assert code == 1, out + err
    (line,) = [line for line in out.splitlines() if "loopback_allreduce" in line]
    assert FIX in line and "ip link set lo up" in line, line
    assert "Unable to find interface" not in out
