"""A full disk during a checkpoint save, for real: a tmpfs of a few hundred KiB mounted in a
private mount namespace (``unshare -m``: gone with the command, invisible to the rest of the
machine; root needed, skipped with the reason otherwise).

- the save's own error is one line naming the disk, its free space, what the checkpoint needs
  and the fix, not torch's ``unexpected pos A vs B``; nothing half-written is left;
- ``ddpkit train``, and a script whose rank 0 ends a second after rank 1: the launcher's first
  failure is rank 0's own error (the cause), not rank 1's ``DistributedError`` that echoes it;
- a sharded (fsdp) save: the same line through ``torch.distributed.checkpoint``, not its
  ``CheckpointException ranks:dict_keys([0, 1])``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import Completed, run_cli

SCRIPT = str(Path(__file__).parent / "scripts" / "full_disk_save.py")
FIX = (
    "Free space there, write checkpoints to a disk with room (ddpkit train --output-dir DIR; "
    "CheckpointManager's directory), or keep fewer (CheckpointManager keep_last: a save needs "
    "room for one more checkpoint before the oldest is pruned)."
)
# the mount, the command, then what the folder holds after it (the tmpfs ends with the command)
IN_TMPFS = 'mount -t tmpfs -o size="$1" tmpfs "$2" && shift 3 && "$@"; rc=$?; ls -A "$L"; exit $rc'


@pytest.fixture(scope="module")
def tmpfs_allowed(tmp_path_factory) -> None:
    """Skip where a tmpfs cannot be mounted in a private mount namespace."""
    mount = tmp_path_factory.mktemp("probe")
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {mount}"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a private mount namespace: {probe.stderr.strip()}")


def _in_tmpfs(mount: Path, size: str, listed: Path, python_args: list[str]) -> Completed:
    """``python python_args`` with a ``size`` tmpfs at ``mount``; prints ``ls -A listed`` after."""
    mount.mkdir(exist_ok=True)
    return run_cli(
        ["-c", IN_TMPFS, "sh", size, str(mount), "-", sys.executable, *python_args],
        env={"L": str(listed)},
        program=["unshare", "-m", "sh"],
        timeout_s=180,
    )


@pytest.mark.slow
def test_a_checkpoint_into_a_full_disk_is_one_line_naming_the_disk(tmp_path, tmpfs_allowed):
    directory = tmp_path / "mnt" / "ckpt"
    result = _in_tmpfs(tmp_path / "mnt", "512k", directory, [SCRIPT, "io", str(directory)])
    probe, write = [json.loads(line) for line in result.stdout.splitlines()[:2]]
    needs = f"the disk holding {directory} is full (free=0 B of 512.0 KiB); it needs about 1.0 MiB"
    assert probe == {
        "call": "probe",
        "type": "DiskFullError",
        "errno": 28,
        "message": f"trial checkpoint not written: {needs}. {FIX}",
        "stamped": False,  # not a save: no other rank hears of it
        "left_behind": None,  # the folder it made for the trial went with it
    }
    assert write == {
        "call": "write",
        "type": "DiskFullError",
        "errno": 28,
        "message": f"checkpoint step-00000004 not written: {needs}. {FIX}",
        "stamped": True,  # the time it failed, before any collective tells the other ranks
        "left_behind": None,  # no .tmp-step-00000004-PID folder
    }
    assert result.stdout.splitlines()[2:] == []  # ls -A: nothing half-written stayed


@pytest.mark.slow
def test_ddpkit_train_on_a_full_disk_names_rank_0s_own_error_first(tmp_path, tmpfs_allowed):
    # the digits CNN's checkpoint is 1.1 MiB: 2000 KiB hold the one of step 2, not step 4 beside it
    run = tmp_path / "mnt" / "run"
    argv = [
        "-m",
        "ddpkit",
        "train",
        "--nproc",
        "2",
        "--dataset",
        "digits",
        "--epochs",
        "1",
        "--max-steps",
        "4",
        "--checkpoint-every",
        "2",
        "--output-dir",
        str(run),
    ]
    result = _in_tmpfs(tmp_path / "mnt", "2000k", run / "checkpoints", argv)
    assert result.returncode == 1, result.output
    lines = result.stderr[result.stderr.index("ddpkit train: first failure") :].splitlines()
    assert re.fullmatch(
        r"ddpkit train: first failure: rank 0/2 \(local rank 0, pid \d+\): DiskFullError: "
        rf"checkpoint step-00000004 not written: the disk holding {run}/checkpoints is full "
        rf"\(free=0 B of 2\.0 MiB\); it needs about 1\.1 MiB\. {re.escape(FIX)}",
        lines[0],
    ), result.stderr
    assert lines[1].startswith("ddpkit train: job FAILED; all 2 processes stopped"), lines
    # rank 1 said what it heard, in its own output, not as the job's first failure
    assert "[rank 1/2] DistributedError: checkpoint step 4 not written: rank 0 failed to " in (
        result.stderr
    )
    assert "unexpected pos" not in result.stderr
    assert result.stdout.splitlines()[-2:] == [".ddpkit-lock", "step-00000002"]  # ls -A


def _run_on_full_disk(tmp_path, strategy: str):
    """``ddpkit run -n 2`` of the save script on a 512 KiB tmpfs: (result, the checkpoint
    folder, the lines from the first failure on)."""
    directory = tmp_path / "mnt" / "ckpt"
    argv = ["-m", "ddpkit", "run", "-n", "2", SCRIPT, strategy, str(directory)]
    result = _in_tmpfs(tmp_path / "mnt", "512k", directory, argv)
    assert result.returncode == 1, result.output
    return result, directory, result.stderr[result.stderr.index("ddpkit run: first failure") :]


@pytest.mark.slow
def test_rank_0s_failed_write_leads_even_when_rank_0_ends_last(tmp_path, tmpfs_allowed):
    # rank 1's DistributedError is raised the moment rank 0's error reaches it; rank 0's own
    # teardown then takes a second longer: the cause still leads, by the time it failed
    result, directory, summary = _run_on_full_disk(tmp_path, "ddp")
    lines = summary.splitlines()
    assert re.fullmatch(
        r"ddpkit run: first failure: rank 0/2 \(local rank 0, pid \d+\): DiskFullError: "
        rf"checkpoint step-00000001 not written: the disk holding {directory} is full "
        rf"\(free=0 B of 512\.0 KiB\); it needs about 1\.0 MiB\. {re.escape(FIX)}",
        lines[0],
    ), result.stderr
    assert "[rank 1/2] DistributedError: checkpoint step 1 not written: rank 0 failed " in (
        result.stderr
    )
    assert result.stdout.splitlines()[-1:] == [".ddpkit-lock"]  # ls -A: no .tmp- folder


@pytest.mark.slow
def test_a_sharded_save_on_a_full_disk_says_so_not_checkpointexception(tmp_path, tmpfs_allowed):
    result, directory, summary = _run_on_full_disk(tmp_path, "fsdp")
    lines = summary.splitlines()
    assert re.fullmatch(
        r"ddpkit run: first failure: rank [01]/2 \(local rank [01], pid \d+\): DistributedError: "
        r"sharded checkpoint step 1 not written: writing the shards failed \(ranks 0, 1: "
        r"DiskFullError: the shards of checkpoint step-00000001 not written: the disk holding "
        rf"{directory} is full \(free=0 B of 512\.0 KiB\)\. {re.escape(FIX)}\)\. No complete "
        r"step folder was left behind; resume falls back to the previous one\.",
        lines[0],
    ), result.stderr
    assert "CheckpointException" not in result.stderr
    assert result.stdout.splitlines()[-1:] == [".ddpkit-lock"]  # ls -A: no shard, no .tmp-
