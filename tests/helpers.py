"""Shared helpers for tests that run ddpkit as a user would: subprocesses with a hard timeout."""

from __future__ import annotations

import contextlib
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
    timeout kill the whole process group.

    ``python -m ddpkit ...`` runs warm (:func:`_run_warm`): the same command in a process
    forked from the test harness's forkserver, which has imported torch and ddpkit already.
    """
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if program is None and args[:2] == ["-m", "ddpkit"] and _warm_env_ok(env or {}):
        return _run_warm(args[2:], timeout_s, full_env, cwd)
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


def _warm_env_ok(env: dict[str, str]) -> bool:
    """Whether a command given ``env`` runs the same warm: not when it sets a ``PYTHON*``
    variable other than ``PYTHONUNBUFFERED`` (``PYTHONPATH``'s fault hooks, ``PYTHONHASHSEED``),
    which a fresh interpreter reads as it starts."""
    return not any(name.startswith("PYTHON") and name != "PYTHONUNBUFFERED" for name in env)


def _warm_main(argv: list[str], env: dict[str, str], cwd: str | None, out: str, err: str) -> None:
    """A forked process becomes ``python -m ddpkit ARGV``: its own session, ``env``, ``cwd``,
    stdout and stderr in the files ``out`` and ``err`` (line-buffered, as ``-u`` would write
    them), the exit status as the command's."""
    import runpy

    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND), fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.argv = ["ddpkit", *argv]
    code: object = 0
    try:
        runpy.run_module("ddpkit", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, status 1
        import traceback

        traceback.print_exc()
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def _run_warm(argv: list[str], timeout_s: float, env: dict[str, str], cwd: str | None) -> Completed:
    """``python -m ddpkit ARGV`` forked from the harness's forkserver (torch, ddpkit and the
    comm hooks imported once per test worker, not once per command: ~1.5 CPU-s saved each)."""
    import multiprocessing
    import tempfile

    from ddpkit.launch.spawn import _ensure_forkserver

    _ensure_forkserver()
    with tempfile.TemporaryDirectory(prefix="ddpkit-cli-") as folder:
        out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        for path in (out, err):
            Path(path).touch()
        proc = multiprocessing.get_context("forkserver").Process(
            target=_warm_main, args=(argv, env, cwd, out, err), name="ddpkit-cli"
        )
        proc.start()
        proc.join(timeout_s)
        if proc.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.join()
            text = Path(out).read_text() + "\n" + Path(err).read_text()
            pytest.fail(f"ddpkit {argv} timed out after {timeout_s} s\n{text}")
        return Completed(proc.exitcode, Path(out).read_text(), Path(err).read_text())


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
    from ddpkit.env import descendant_pids

    return {pid, *descendant_pids(pid)}


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
