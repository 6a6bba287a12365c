"""One job per checkpoint folder: a second job is refused naming the first; a dead job's lock
is no obstacle (``ddpkit.checkpoint.lock``). The other job is a real process
(``ddpkit.testing.checkpoint_writer``: it saves step after step, as a training job does)."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch import nn

import ddpkit
from ddpkit.checkpoint.io import list_checkpoints
from ddpkit.checkpoint.lock import LOCK_NAME
from ddpkit.env import ProcessInfo
from ddpkit.runtime.process_group import Runtime
from tests.helpers import checkpoint_writer


def _manager(directory: Path, rank: int = 0, world_size: int = 1) -> ddpkit.CheckpointManager:
    runtime = Runtime(ProcessInfo(rank=rank, world_size=world_size, local_world_size=world_size))
    model = nn.Linear(256, 256)  # the writer's model
    return ddpkit.CheckpointManager(directory, runtime, state={"model": model})


@pytest.mark.slow  # a writer process importing torch: out of the inner loop
def test_a_second_job_is_refused_naming_the_first_and_a_killed_job_leaves_no_lock(tmp_path):
    first = checkpoint_writer(tmp_path)
    try:
        with pytest.raises(ddpkit.ConfigError) as refused:
            _manager(tmp_path)
        message = str(refused.value)
        assert "\n" not in message
        assert f"checkpoint folder {tmp_path} is in use by another job: pid {first.pid} " in message
        assert f"on {socket.gethostname()} (" in message and "checkpoint_writer" in message
        assert "give this job another folder" in message
        assert first.poll() is None  # the first job goes on saving, untouched
        saved = len(list_checkpoints(tmp_path))
        deadline = time.monotonic() + 30
        while len(list_checkpoints(tmp_path)) == saved or first.poll() is not None:
            assert first.poll() is None and time.monotonic() < deadline, "the first job stopped"
            time.sleep(0.01)
        # a rank other than 0 takes no lock: the job's rank 0 holds it for all of them
        _manager(tmp_path, rank=1, world_size=2)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
    # kill -9 released the lock (the kernel drops a flock with its holder): no stale lock
    ckpt = _manager(tmp_path)
    owner = json.loads((tmp_path / LOCK_NAME).read_text())
    assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname()
    assert ckpt.resume() > 0  # the killed job's newest complete checkpoint


@pytest.mark.slow  # a writer process importing torch: out of the inner loop
def test_managers_of_one_process_share_the_lock_until_the_last_goes(tmp_path):
    one, two = _manager(tmp_path), _manager(tmp_path)  # e.g. a job that rebuilds its manager
    one.save(1)
    del one
    refused = subprocess.run(
        [sys.executable, "-m", "ddpkit.testing.checkpoint_writer", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode != 0 and refused.stdout == ""
    assert f"is in use by another job: pid {os.getpid()} " in refused.stderr
    two.save(2)
    del two  # the last manager of this process: the lock is released
    checkpoint_writer(tmp_path).kill()


def test_a_folder_that_cannot_be_written_is_refused_when_the_manager_is_built(tmp_path):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ddpkit.ConfigError, match=r"^checkpoint folder .*a_file/ck cannot be "):
        _manager(tmp_path / "a_file" / "ck")


def test_a_forked_child_does_not_keep_the_lock_and_a_file_system_without_locks_is_warned(
    tmp_path, monkeypatch, caplog
):
    from ddpkit.checkpoint import lock

    ckpt = _manager(tmp_path / "a")
    read, write = os.pipe()
    pid = os.fork()  # as a DataLoader worker is started after the manager
    if pid == 0:
        os.write(write, str(len(lock._held)).encode())
        os._exit(0)
    os.close(write)
    assert os.read(read, 16) == b"0"  # the child closed its copy: the lock is the parent's alone
    os.waitpid(pid, 0)
    with pytest.raises(ddpkit.ConfigError, match="in use by another job"):
        lock.check_unlocked(tmp_path / "a")  # a shared probe: the parent still holds it
    del ckpt

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lock.fcntl, "flock", no_locks)  # e.g. an NFS mount without a lock service
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        _manager(tmp_path / "b").save(1)  # checkpoints still work
        lock.check_unlocked(tmp_path / "b")
    assert "its file system has no flock (No locks available): one job per folder is not " in (
        caplog.text
    )
