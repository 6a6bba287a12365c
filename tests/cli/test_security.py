"""Rendezvous security on a real `ddpkit run` job: loopback-only listeners, the job token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests.helpers import checkpoint_writer, descendants, listening_sockets, pid_alive, run_cli

TOKEN = "0123456789abcdef0123456789abcdef"

JOB = """
import json, os, time
from pathlib import Path
import ddpkit

folder = Path(os.environ["TEST_DIR"])
with ddpkit.init_runtime("gloo", init_timeout_s=60) as rt:
    if rt.rank == 0:
        info = {"addr": os.environ["MASTER_ADDR"], "port": os.environ["MASTER_PORT"]}
        (folder / "store.tmp").write_text(json.dumps(info))
        os.replace(folder / "store.tmp", folder / "store.json")
    deadline = time.monotonic() + 90
    while not (folder / "go").exists():  # the test inspects the running job, then says go
        if time.monotonic() > deadline:
            raise TimeoutError("the test never said go")
        time.sleep(0.05)
    print(f"rank {rt.rank} sum {ddpkit.all_reduce_sum([rt.rank + 1.0], rt).item()}")
"""

INTRUDER = "import ddpkit; ddpkit.init_runtime('gloo', init_timeout_s=10)"


def _wait_for(path, proc, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            out, err = proc.communicate(timeout=10) if proc.poll() is not None else ("", "")
            pytest.fail(f"the job did not start: {out}\n{err}")
        time.sleep(0.05)


def _start_job(tmp_path, token: str | None) -> subprocess.Popen:
    """``ddpkit run -n 2`` of :data:`JOB` in its own session, with ``token`` or none."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    env = {**os.environ, "TEST_DIR": str(tmp_path)}
    env.pop("DDPKIT_JOB_TOKEN", None)
    if token:
        env["DDPKIT_JOB_TOKEN"] = token
    return subprocess.Popen(
        [sys.executable, "-m", "ddpkit", "run", "-n", "2", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )


def _intruder_env(store: dict, token: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDPKIT_", "TORCHELASTIC"))}
    env.update(
        MASTER_ADDR=store["addr"],
        MASTER_PORT=store["port"],
        RANK="1",
        LOCAL_RANK="1",
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
    )
    if token is not None:
        env["DDPKIT_JOB_TOKEN"] = token
    return env


@pytest.mark.slow
def test_job_listens_on_loopback_only_and_refuses_a_wrong_token(tmp_path):
    job = _start_job(tmp_path, TOKEN)
    try:
        _wait_for(tmp_path / "store.json", job)
        listeners = listening_sockets(descendants(job.pid))
        # the launcher's rendezvous store, rank 0's job store, and gloo's listeners
        assert len(listeners) >= 3, listeners
        assert {address for address, _ in listeners} == {"127.0.0.1"}, listeners

        store = json.loads((tmp_path / "store.json").read_text())
        for token, expected in (
            ("f" * 32, "the job token (DDPKIT_JOB_TOKEN/DDPKIT_JOB_TOKEN_FILE) does not match"),
            (None, "this job requires a job token"),
        ):
            intruder = run_cli(["-c", INTRUDER], env=_intruder_env(store, token), timeout_s=60)
            assert intruder.returncode == 1
            assert f"refused to join as rank 1: {expected}" in intruder.stderr
            assert TOKEN not in intruder.output and "f" * 32 not in intruder.output

        (tmp_path / "go").touch()
        out, err = job.communicate(timeout=90)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
            job.communicate()
    assert job.returncode == 0, out + err
    assert "rank 0 sum 3.0" in out and "rank 1 sum 3.0" in out  # the job was not disturbed
    assert TOKEN not in out + err


@pytest.mark.slow
def test_bad_token_settings_are_refused_before_any_worker_starts(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("raise SystemExit('a worker started')\n")
    (tmp_path / "empty").write_text("")
    for env in (
        {"DDPKIT_JOB_TOKEN": "short-secret"},
        {"DDPKIT_JOB_TOKEN_FILE": str(tmp_path / "empty")},
    ):
        result = run_cli(["-m", "ddpkit", "run", "-n", "2", str(script)], env=env, timeout_s=60)
        assert result.returncode == 2, result.output
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "a worker started" not in result.output and "short-secret" not in result.output


class _Payload:
    """Unpickled, it creates the folder ``path``: proof that code from the store ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _poison_rendezvous_state(launcher_pid: int, payload: bytes) -> str:
    """As a local process without the token would: find the launcher's rendezvous store, list
    its keys, overwrite torchrun's rendezvous state with ``payload``. Returns the key."""
    import base64
    from datetime import timedelta

    import torch.distributed as dist

    for _, port in listening_sockets({launcher_pid}):
        client = dist.TCPStore(
            "127.0.0.1", port, is_master=False, use_libuv=True, timeout=timedelta(seconds=10)
        )
        keys = [k for k in client.list_keys() if k.startswith("torch.rendezvous.") and "/" not in k]
        if keys:
            client.set(keys[0], base64.b64encode(payload).decode())
            return keys[0]
    pytest.fail(f"no rendezvous state in the launcher's stores {listening_sockets({launcher_pid})}")


@pytest.mark.slow
@pytest.mark.parametrize("token", [None, TOKEN], ids=["no-token", "token"])
def test_a_pickle_written_into_the_rendezvous_store_never_runs(tmp_path, token):
    # torchrun unpickles its rendezvous state from the store several times a second: under plain
    # torchrun this payload runs in the agent within a second (docs/security.md).
    import pickle

    marker = tmp_path / "payload-ran"
    job = _start_job(tmp_path, token)
    try:
        _wait_for(tmp_path / "store.json", job)
        workers = descendants(job.pid) - {job.pid}
        _poison_rendezvous_state(job.pid, pickle.dumps(_Payload(str(marker))))
        out, err = job.communicate(timeout=60)  # the workers never see "go": the job must stop
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
            job.communicate()
    assert not marker.exists()
    assert job.returncode == 1, out + err
    lines = [line for line in err.splitlines() if "rendezvous state refused" in line]
    assert len(lines) == 1, err
    assert "nothing of it was unpickled" in lines[0]
    reason = "is not signed with this job's key"  # a random key of the launcher's, or the token's
    assert reason in lines[0], lines[0]
    assert "Traceback" not in err, err
    assert not any(pid_alive(pid) for pid in workers)


@pytest.mark.slow  # a process importing torch: out of the inner loop
def test_a_second_train_on_a_running_jobs_folder_is_refused_before_any_worker_starts(
    tmp_path, mnist_dir
):
    checkpoints = tmp_path / "out" / "checkpoints"
    first = checkpoint_writer(checkpoints)  # a running job, saving into the folder
    try:
        second = run_cli(
            [
                "-m",
                "ddpkit",
                "train",
                "--nproc",
                "2",
                "--data-dir",
                str(mnist_dir),
                "--output-dir",
                str(tmp_path / "out"),
                "--max-steps",
                "20",
                "--progress",
                "off",
            ],
            timeout_s=60,
        )
        assert second.returncode == 2, second.stderr[-2000:]
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and "[rank" not in second.stdout + second.stderr, second
        assert f"is in use by another job: pid {first.pid} on " in lines[0]
        assert first.poll() is None and list(checkpoints.glob("step-*/manifest.json"))
    finally:
        first.kill()
        first.wait(timeout=10)
