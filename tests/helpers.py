"""Shared helpers for tests that run ddpkit as a user would: subprocesses with a hard timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass
class Completed:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def run_cli(
    args: list[str],
    timeout_s: float = 120,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    program: list[str] | None = None,
) -> Completed:
    """Run ``python <args>`` (or ``program + args``, e.g. ``["bash"]``) in a new session; on
    timeout kill the whole process group."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(
        [*(program or [sys.executable]), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        pytest.fail(f"{args} timed out after {timeout_s} s\n{out}\n{err}")
    return Completed(proc.returncode, out, err)


FAULTS_DIR = Path(__file__).parent / "faults"


def fault_env(
    *,
    kill_at: str | None = None,
    slow_save_s: float | None = None,
    slow_eval_s: float | None = None,
) -> dict[str, str]:
    """The environment that injects faults into a ``ddpkit`` command's processes, from outside
    the library (tests/faults/sitecustomize.py, put first on ``PYTHONPATH``; see there).

    Args:
        kill_at: ``"RANK:STEP"``: that rank SIGKILLs itself after optimizer step STEP (first
            attempt only).
        slow_save_s: every checkpoint write (and the start-up probe) takes this much longer.
        slow_eval_s: every evaluation waits this long first.
    """
    faults = {
        "DDPKIT_FAULT_INJECT": kill_at,
        "DDPKIT_TEST_SLOW_SAVE_S": slow_save_s,
        "DDPKIT_TEST_SLOW_EVAL_S": slow_eval_s,
    }
    paths = [str(FAULTS_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {name: str(value) for name, value in faults.items() if value is not None}
    return {"PYTHONPATH": os.pathsep.join(paths), **env}


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def descendants(pid: int) -> set[int]:
    """``pid`` and every process below it (from /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    parents[int(entry)] = int(handle.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
    found = {pid}
    while True:
        more = {child for child, parent in parents.items() if parent in found} - found
        if not more:
            return found
        found |= more


def listening_sockets(pids: set[int]) -> list[tuple[str, int]]:
    """``(address, port)`` of every TCP socket in LISTEN state held by ``pids`` (IPv4 and v6)."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except (FileNotFoundError, PermissionError, ProcessLookupError):
            continue
    found = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        with open(table) as handle:
            for line in handle.readlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state != "0A" or inode not in inodes:  # 0A: LISTEN
                    continue
                address_hex, port_hex = local.split(":")
                if v6:
                    address = "v6:" + address_hex
                else:
                    address = ".".join(str(b) for b in reversed(bytes.fromhex(address_hex)))
                found.append((address, int(port_hex, 16)))
    return found


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    """Call ``ddpkit`` in-process; returns ``(exit status, stderr)`` (argparse exits too)."""
    from ddpkit.cli import main

    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    return code, capsys.readouterr().err


def checkpoint_writer(directory: Path) -> subprocess.Popen:
    """Start a checkpoint-writing job on ``directory``; return once it saved one checkpoint."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpkit.testing.checkpoint_writer", str(directory)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready", proc.communicate(timeout=30)[1][-2000:]
    deadline = time.monotonic() + 30
    while not list(directory.glob("step-*/manifest.json")):
        assert time.monotonic() < deadline, "the writer saved nothing in 30 s"
        time.sleep(0.01)
    return proc
