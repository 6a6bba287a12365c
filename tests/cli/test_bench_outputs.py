"""``ddpkit bench``'s report files and Ctrl-C: a path that cannot take the report is refused
before anything is measured (one line, exit 2, nothing written), and Ctrl-C stops every rank
with one line and exit status 130.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from ddpkit.bench.report import write_csv, write_json
from ddpkit.errors import ConfigError
from tests.helpers import descendants, pid_alive, run_main

BENCHES = {
    "allreduce": ["--csv", "{bad}"],
    "overhead": ["--forms", "raw_ddp", "--csv", "{bad}"],
    "scaling": ["--csv", "{bad}"],
}


@pytest.mark.parametrize("bench", sorted(BENCHES))
def test_unwritable_csv_is_refused_before_measuring(tmp_path, capsys, monkeypatch, bench):
    # a path under a regular file can never be created, even as root
    (tmp_path / "afile").write_text("")
    bad = tmp_path / "afile" / "x.csv"
    started = []
    monkeypatch.setattr("ddpkit.launch.spawn.run_distributed", lambda *a, **k: started.append(a))
    argv = ["bench", bench, *[arg.format(bad=bad) for arg in BENCHES[bench]]]
    code, err = run_main(argv, capsys)
    assert code == 2, err
    assert f"--csv {bad}: {tmp_path / 'afile'} is not a folder" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert started == []  # refused before any rank was started


def test_report_path_that_is_a_folder_is_refused(tmp_path, capsys):
    code, err = run_main(["bench", "allreduce", "--json", str(tmp_path)], capsys)
    assert code == 2 and f"--json {tmp_path} is a folder" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_a_failed_write_is_a_config_error_and_leaves_nothing(tmp_path):
    (tmp_path / "afile").write_text("")
    for write, payload in ((write_csv, [{"a": 1}]), (write_json, {"a": 1})):
        with pytest.raises(ConfigError, match="cannot write the report: path="):
            write(tmp_path / "afile" / "r.out", payload)
    target = tmp_path / "dir-in-the-way"
    target.mkdir()
    with pytest.raises(ConfigError, match="Is a directory"):
        write_json(target, {"a": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "dir-in-the-way"]


@pytest.mark.slow
def test_ctrl_c_stops_every_rank_with_one_line_exit_130(tmp_path):
    # Ctrl-C sends SIGINT to the whole foreground process group: the ranks get it too.
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    argv = ["-m", "ddpkit", "bench", "overhead", "--forms", "raw_ddp", "--rounds", "1"]
    proc = subprocess.Popen(
        [sys.executable, *argv, "--steps", "400", "--warmup", "0", "--timeout", "300"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as in a terminal
    )
    try:
        deadline = time.monotonic() + 120
        ranks: set[int] = set()
        while len(ranks) < 2 and time.monotonic() < deadline:  # the two ranks
            time.sleep(0.5)
            ranks = {p for p in descendants(proc.pid) - {proc.pid} if _is_rank(p)}
        assert len(ranks) == 2, f"ranks never started: {ranks}"
        time.sleep(3)  # inside the step loop
        started = descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == (
        "ddpkit bench: interrupted (Ctrl-C); every process it started is stopped."
    ), err
    assert "Traceback" not in err.splitlines()[-1]
    deadline = time.monotonic() + 10  # the command has exited: its children are already dead
    while any(pid_alive(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in started if pid_alive(pid)] == []


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read()
    except OSError:
        return b""


def _is_rank(pid: int) -> bool:
    """A spawned rank, or a rank forked from the forkserver (whose parent is the forkserver)."""
    if b"spawn_main" in _cmdline(pid):
        return True
    try:
        with open(f"/proc/{pid}/stat") as handle:
            parent = int(handle.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError):
        return False
    return all(b"forkserver import main" in _cmdline(p) for p in (pid, parent))


def test_a_sweep_that_cannot_fit_in_memory_is_refused_before_allocating(capsys, monkeypatch):
    # 2 ranks x (buffer + gloo scratch) x 512 MiB = 2 GiB > the 1 GiB available; 256 MiB fits
    monkeypatch.setattr("ddpkit.bench.allreduce.available_memory_bytes", lambda: 2**30)
    allocated = []
    monkeypatch.setattr("ddpkit.bench.allreduce.memcpy_gbps", lambda *a: allocated.append(a))
    code, err = run_main(["bench", "allreduce", "-b", "4K", "-e", "512M"], capsys)
    assert code == 2 and allocated == [], err
    assert "--max-bytes 536870912 bytes need about 2.0 GiB of memory" in err, err
    assert "but 1.0 GiB is available" in err and len(err.strip().splitlines()) == 1, err
    from ddpkit.bench.allreduce import memory_problem

    assert memory_problem(256 * 2**20, 2, "gloo") is None  # exactly the available memory
    assert memory_problem(2**40, 2, "nccl") is None  # GPU memory is not checked here
