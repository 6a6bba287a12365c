"""docs/fault-tolerance.md's own loop, copied out of the page and run as a user would: as one
process, as a plain 2-rank DDP job, and with live fault tolerance while one rank is killed.

The live run appends one line to the block (after it, outside the loop): each replica prints
its rank and the SHA-256 of its parameters, so the test can tell the replicas ended equal.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import descendants, run_cli

DOC = Path(__file__).resolve().parents[2] / "docs" / "fault-tolerance.md"
EPOCH = re.compile(r"^epoch (\d+) step (\d+) world (\d+) loss (\S+) accuracy (\S+)$", re.M)
CHECKSUM = """
import hashlib
digest = hashlib.sha256(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy())
print(f"REPLICA {rt.rank} {digest.hexdigest()}", flush=True)
"""
pytestmark = pytest.mark.timeout(300)


def doc_loop() -> str:
    blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), re.S | re.M)
    loops = [b for b in blocks if b.startswith("# live_train.py")]
    assert len(loops) == 1, "docs/fault-tolerance.md must hold one python block # live_train.py"
    return loops[0]


@pytest.mark.parametrize("launch", ["python", "ddpkit_run"])
def test_the_doc_loop_runs_as_one_process_and_as_plain_ddp(launch, tmp_path):
    (tmp_path / "live_train.py").write_text(doc_loop())
    command = {
        "python": ["live_train.py"],
        "ddpkit_run": ["-m", "ddpkit", "run", "-n", "2", "live_train.py"],
    }[launch]
    result = run_cli(command, env={"EPOCHS": "2"}, cwd=str(tmp_path), timeout_s=200)
    assert result.returncode == 0, result.output
    world = 1 if launch == "python" else 2
    epochs = EPOCH.findall(result.stdout)
    assert [(int(e), int(w)) for e, _, w, _, _ in epochs] == [(0, world), (1, world)], result.output
    assert float(epochs[-1][4]) > 0.5, result.output


def test_the_doc_loop_survives_a_killed_rank_with_live_fault_tolerance(tmp_path):
    (tmp_path / "live_train.py").write_text(doc_loop() + CHECKSUM)
    command = [
        sys.executable,
        "-m",
        "ddpkit",
        "run",
        "-n",
        "3",
        "--fault-tolerance",
        "live",
        "--spares",
        "1",
        "--heartbeat-timeout",
        "30",
        "live_train.py",
    ]
    proc = subprocess.Popen(
        command,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "EPOCHS": "30", "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:  # the first epoch's line: training runs, kill one rank
        lines.append(line)
        if line.startswith("epoch 2 "):
            break
    workers = [pid for pid in descendants(proc.pid) if _is_worker(pid)]
    assert len(workers) == 3, "".join(lines)
    os.kill(sorted(workers)[1], signal.SIGKILL)
    try:
        rest, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("".join(lines) + proc.communicate()[0])
    output = "".join(lines) + rest
    assert proc.returncode == 0, output
    assert re.search(r"live: slot \d died \(SIGKILL\)", output), output
    assert re.search(r"slot\(s\) \d healed from slot \d \(rank 0\)", output), output
    replicas = dict(re.findall(r"^REPLICA (\d) (\w+)$", output, re.M))
    assert sorted(replicas) == ["0", "1", "2"] and len(set(replicas.values())) == 1, output
    last = EPOCH.findall(output)[-1]
    assert int(last[0]) == 29 and int(last[2]) == 3 and float(last[4]) > 0.8, output


def _is_worker(pid: int) -> bool:
    time.sleep(0)
    try:
        return b"ddpkit.launch.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def test_a_plain_loop_is_refused_in_one_line_with_live_fault_tolerance(tmp_path):
    # the README's loop steps its optimizer itself: under live fault tolerance nothing would
    # all-reduce its gradients (no DDP wrapper), so its first forward is refused, naming the fix
    from tests.e2e.test_readme_example import readme_example

    (tmp_path / "train.py").write_text(readme_example())
    result = run_cli(
        [
            "-m",
            "ddpkit",
            "run",
            "-n",
            "2",
            "--fault-tolerance",
            "live",
            "--max-restarts",
            "0",
            "train.py",
        ],
        env={"EPOCHS": "1"},
        cwd=str(tmp_path),
        timeout_s=200,
    )
    assert result.returncode == 1, result.output
    assert (
        "LiveModelError: live fault tolerance: this model's gradients are all-reduced by "
        "ddpkit.TrainStep" in result.output
    ), result.output
    assert "job FAILED: no live member is left to go on" in result.output.splitlines()[-1]


def test_live_under_plain_torchrun_is_refused_in_one_line(tmp_path):
    (tmp_path / "live_train.py").write_text(doc_loop())
    result = run_cli(
        ["-m", "torch.distributed.run", "--nproc-per-node", "2", "live_train.py"],
        env={"EPOCHS": "1", "DDPKIT_FAULT_TOLERANCE": "live"},
        cwd=str(tmp_path),
        timeout_s=200,
    )
    assert result.returncode != 0, result.output
    assert (
        "fault_tolerance='live' needs its launcher: start the job with ddpkit run "
        "--fault-tolerance live" in result.output
    ), result.output
