"""``ddpkit train`` with its exporters on, end to end: the Prometheus endpoint scraped while a
2-rank job trains, the MLflow and W&B runs read back after it, a stopped job's MLflow run, and
the flags refused before any worker starts.

Each job is a real ``python -m ddpkit train`` on 2 ranks and the digits data (a few ms a step on
2 cores: hundreds of steps in a few seconds), in its own session with a hard timeout; on a
timeout or a failed assertion every process it started is killed. The endpoint's port is 0
(the system picks; the job logs the URL), never a fixed one. Waits are polls of a ready
condition with a deadline, never a sleep.

    pytest -q tests/e2e/test_exporters_e2e.py -p no:cacheprovider
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ddpkit.monitoring.prometheus import PHASES
from ddpkit.security.bind import local_address_towards
from tests.helpers import descendants, listening_sockets, pid_alive, run_cli
from tests.unit.test_monitoring_exporters import items, read_wandb_records, refused, samples

pytestmark = pytest.mark.slow

TRAIN = ["-m", "ddpkit", "train", "--nproc", "2", "--dataset", "digits", "--progress", "off"]
# 180 steps of 8 global samples per epoch; a per-rank window every 5 steps
SCRAPED = ["--epochs", "3", "--batch-size", "4", "--lr", "0.01", "--straggler-window", "5"]
URL_LINE = re.compile(r"^Prometheus metrics of every rank at (http://127\.0\.0\.1:(\d+)/metrics)$")
DDPKIT_LINES = (  # every line ddpkit train prints on stdout in this run; anything else is not
    "Prometheus metrics of every rank at ",
    "experiment tracking to mlflow: ",
    "training digits ",
    "gradient sync: ",
    "straggler cleared: ",
    "epoch ",
    "goodput ",
    "wrote ",
)
PER_RANK = (
    "ddpkit_step",
    "ddpkit_samples_per_second",
    "ddpkit_last_step_timestamp_seconds",
    *(f"ddpkit_step_phase_seconds/{phase}" for phase in PHASES),
)


def _environment(tmp: Path) -> dict[str, str]:
    """The job's environment: no tracker settings of the caller (the defaults under test),
    W&B's own folders in ``tmp`` (not the home folder)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for name in ("CONFIG", "CACHE", "DATA"):
        env[f"WANDB_{name}_DIR"] = str(tmp / f"wandb-{name.lower()}")
    return env


class Job:
    """A ``ddpkit train`` in its own session, its output in files; :meth:`kill` ends it all."""

    def __init__(self, flags: list[str], out: Path) -> None:
        pytest.importorskip("sklearn", reason="the digits data needs scikit-learn")
        self.out = out
        self._stdout = open(out.parent / f"{out.name}.stdout", "w+")  # noqa: SIM115
        self._stderr = open(out.parent / f"{out.name}.stderr", "w+")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, *TRAIN, *flags, "--output-dir", str(out)],
            stdout=self._stdout,
            stderr=self._stderr,
            env=_environment(out.parent),
            start_new_session=True,
        )
        self.started = {self.proc.pid}

    def poll_until(self, condition, what: str, timeout_s: float = 120):
        """``condition()``'s first true value, polled while the job runs; fails after
        ``timeout_s`` or when the job ends first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = condition()
            self.started |= descendants(self.proc.pid)
            if found:
                return found
            if self.proc.poll() is not None:
                pytest.fail(f"the job ended (exit {self.proc.returncode}) before {what}: {self}")
            time.sleep(0.02)
        pytest.fail(f"no {what} within {timeout_s} s: {self}")

    def finish(self, timeout_s: float = 120) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the job did not end within {timeout_s} s (a hang): {self}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            for pid in descendants(self.proc.pid) | self.started:
                if pid_alive(pid):
                    os.kill(pid, signal.SIGKILL)
            self.proc.wait()

    def leftovers(self) -> list[int]:
        return [pid for pid in self.started if pid_alive(pid)]

    def stdout(self) -> str:
        self._stdout.seek(0)
        return self._stdout.read()

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read()

    def __str__(self) -> str:
        return f"\n--- stdout\n{self.stdout()[-3000:]}\n--- stderr\n{self.stderr()[-3000:]}"


def per_rank(found: dict) -> dict[str, dict[str, float]]:
    """``{rank: {metric (or metric/phase): value}}`` of a scrape's per-rank series."""
    ranks: dict[str, dict[str, float]] = {}
    for (name, label_items), value in found.items():
        labels = dict(label_items)
        if "rank" in labels:
            metric = f"{name}/{labels['phase']}" if "phase" in labels else name
            ranks.setdefault(labels["rank"], {})[metric] = value
    return ranks


def get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=2) as response:
        return response.read().decode()


@dataclass
class Scraped:
    """What one job with the endpoint and both trackers showed, during and after its run."""

    out: Path
    port: int
    scrapes: list[tuple[float, dict]] = field(default_factory=list)  # (time.time(), samples)
    listening: list[tuple[str, int]] = field(default_factory=list)
    elsewhere: tuple[str, bool] | None = None  # (non-loopback address, refused there)
    returncode: int = -1
    stdout: str = ""
    stderr: str = ""
    refused_after: bool = False
    leftovers: list[int] = field(default_factory=list)


def _scrape_while_it_runs(job: Job, url: str, run: Scraped, timeout_s: float = 150) -> None:
    """Scrape every ~50 ms until the job ends; the first good scrape also records who listens
    on the port and whether the machine's other address is refused."""
    deadline = time.monotonic() + timeout_s
    while job.proc.poll() is None:
        if time.monotonic() > deadline:
            job.kill()
            pytest.fail(f"the job did not end within {timeout_s} s: {job}")
        try:
            text = get(url)
        except OSError:  # not serving yet, or closed as training ended
            time.sleep(0.05)
            continue
        run.scrapes.append((time.time(), samples(text)))
        if len(run.scrapes) == 1:
            job.started |= descendants(job.proc.pid)
            run.listening = [s for s in listening_sockets(job.started) if s[1] == run.port]
            run.elsewhere = _other_address(run.port)
        time.sleep(0.05)


def _other_address(port: int) -> tuple[str, bool] | None:
    try:
        address = local_address_towards("192.0.2.1", 9)  # TEST-NET-1: a UDP connect, no packet
    except OSError:
        return None  # no route off loopback
    return None if address.startswith("127.") else (address, refused(address, port))


@pytest.fixture(scope="module")
def scraped_run(tmp_path_factory) -> Scraped:
    """One 2-rank job, 3 epochs, ``--metrics-port 0 --tracker mlflow,wandb``, scraped."""
    pytest.importorskip("prometheus_client")
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    out = tmp_path_factory.mktemp("exporters") / "run"
    job = Job([*SCRAPED, "--metrics-port", "0", "--tracker", "mlflow,wandb"], out)

    def logged_url() -> re.Match | None:
        return next(filter(None, map(URL_LINE.match, job.stdout().splitlines())), None)

    try:
        found = job.poll_until(logged_url, "the endpoint's URL line")
        run = Scraped(out, int(found.group(2)))
        _scrape_while_it_runs(job, found.group(1), run)
        run.returncode = job.finish()
        run.refused_after = refused("127.0.0.1", run.port)
        run.leftovers = job.leftovers()
        run.stdout, run.stderr = job.stdout(), job.stderr()
        return run
    finally:
        job.kill()


def _epoch_records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_endpoint_shows_every_ranks_progress_while_it_trains_on_loopback_only(scraped_run):
    run = scraped_run
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.listening == [("127.0.0.1", run.port)]  # one socket, on loopback only
    if run.elsewhere is not None:
        assert run.elsewhere[1], f"the endpoint answered on {run.elsewhere[0]}"
    seen = [(at, per_rank(found), found) for at, found in run.scrapes]
    whole = [
        ranks
        for _, ranks, _ in seen
        if set(ranks) == {"0", "1"} and all(m in r for r in ranks.values() for m in PER_RANK)
    ]
    assert whole, f"no scrape of {len(seen)} showed both ranks' figures"
    for ranks in whole:
        for rank in ranks.values():
            assert rank["ddpkit_step"] > 0 and rank["ddpkit_samples_per_second"] > 0, rank
            assert rank["ddpkit_step_phase_seconds/compute"] > 0, rank
            assert rank["ddpkit_step_phase_seconds/step"] > 0, rank
            assert rank["ddpkit_step_phase_seconds/data"] >= 0, rank
            assert rank["ddpkit_step_phase_seconds/comm_wait"] >= 0, rank
    for at, ranks, _ in seen:  # the last step as rank 0 knows it is recent at every scrape
        for rank in ranks.values():
            assert abs(at - rank["ddpkit_last_step_timestamp_seconds"]) < 60, (at, rank)
    for label in ("0", "1"):  # the steps only go forward, and did go forward
        steps = [ranks[label]["ddpkit_step"] for _, ranks, _ in seen if label in ranks]
        assert steps == sorted(steps) and steps[-1] > steps[0], (label, steps)
    _check_goodput(seen, _epoch_records(run.out)[0]["step"])
    assert run.refused_after, f"port {run.port} still answers after the job ended"
    assert run.leftovers == []


def _check_goodput(seen: list, epoch_1_step: int) -> None:
    """NaN while rank 0 is inside epoch 1; a ratio once it stepped past it (rank 0 sets the
    goodput at epoch 1's end, before its next step: no timing in this)."""
    goodput = [
        (ranks["0"]["ddpkit_step"], found[("ddpkit_goodput_ratio", ())])
        for _, ranks, found in seen
        if "0" in ranks
    ]
    assert all(math.isnan(ratio) for step, ratio in goodput if step < epoch_1_step), goodput
    later = [ratio for step, ratio in goodput if step > epoch_1_step]
    assert later, f"no scrape after epoch 1 (step {epoch_1_step}): {goodput[-3:]}"
    assert all(0 < ratio <= 1 for ratio in later), later


def test_mlflow_and_wandb_runs_hold_the_config_and_the_jobs_own_values(scraped_run):
    import mlflow

    run, records = scraped_run, _epoch_records(scraped_run.out)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((run.out / "summary.json").read_text())
    assert [r["epoch"] for r in records] == [1, 2, 3]
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{run.out}/mlflow.db")
    (found,) = client.search_runs([client.get_experiment_by_name("ddpkit").experiment_id])
    assert found.info.status == "FINISHED" and found.info.run_name == "run"
    params = found.data.params
    assert (params["epochs"], params["lr"], params["batch_size"]) == ("3", "0.01", "4")
    assert params["straggler_window"] == "5" and params["tracker"] == "mlflow,wandb"
    for name in ("train_loss", "test_accuracy"):  # each epoch at its optimizer step
        history = client.get_metric_history(found.info.run_id, name)
        assert [(m.step, m.value) for m in history] == [(r["step"], r[name]) for r in records]
    assert found.data.metrics["summary/test_accuracy"] == summary["test_accuracy"]
    assert found.data.metrics["summary/final_step"] == records[-1]["step"] == 540
    saved = client.download_artifacts(found.info.run_id, "summary.json", str(run.out.parent))
    assert json.loads(Path(saved).read_text()) == summary
    _check_wandb(run.out, records, summary)
    assert all(line.startswith(DDPKIT_LINES) for line in run.stdout.splitlines()), run.stdout
    assert "wandb" not in run.stderr.lower(), run.stderr[-3000:]


def _check_wandb(out: Path, records: list[dict], summary: dict) -> None:
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    (run_file,) = run_dir.glob("run-*.wandb")
    wandb_records = read_wandb_records(run_file)
    (wandb_run,) = [r.run for r in wandb_records if r.HasField("run")]
    assert wandb_run.display_name == "run" and wandb_run.project == "ddpkit"
    config = items(wandb_run.config.update)
    assert (config["epochs"], config["lr"], config["batch_size"]) == (3, 0.01, 4)
    history = [items(r.history.item) for r in wandb_records if r.HasField("history")]
    assert [h["_step"] for h in history] == [r["step"] for r in records]
    for logged, record in zip(history, records, strict=True):
        assert logged["train_loss"] == record["train_loss"]
        assert logged["test_accuracy"] == record["test_accuracy"]
    last: dict = {}
    for record in wandb_records:  # in order: later updates win, as in W&B
        if record.HasField("summary"):
            last.update(items(record.summary.update))
    assert last["test_accuracy"] == summary["test_accuracy"]
    (exit_record,) = [r.exit for r in wandb_records if r.HasField("exit")]
    assert exit_record.exit_code == 0


STOP_LINE = re.compile(
    r"^ddpkit train: stopped by SIGTERM after step (\d+) \(epoch \d+/40\); all 2 processes "
    r"stopped; saved: checkpoint step-0*(\d+) in (\S+); resume with: .+ --resume auto$"
)


def test_a_job_stopped_by_sigterm_ends_its_mlflow_run_as_killed(tmp_path):
    mlflow = pytest.importorskip("mlflow")
    out = tmp_path / "stopped"
    job = Job(["--epochs", "40", "--tracker", "mlflow"], out)
    try:
        metrics = out / "metrics.jsonl"
        job.poll_until(
            lambda: metrics.exists() and metrics.read_text().endswith("\n"), "first epoch record"
        )
        os.kill(job.proc.pid, signal.SIGTERM)  # the launcher: it passes the stop to the ranks
        code = job.finish()
    finally:
        job.kill()
    errors = job.stderr()
    assert code == 128 + signal.SIGTERM, errors[-3000:]
    stopped = STOP_LINE.match(errors.strip().splitlines()[-1])
    assert stopped and stopped.group(1) == stopped.group(2), errors[-3000:]
    assert Path(stopped.group(3)) == out / "checkpoints" and "Traceback" not in errors
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{out}/mlflow.db")
    (found,) = client.search_runs([client.get_experiment_by_name("ddpkit").experiment_id])
    assert found.info.status == "KILLED"
    records = _epoch_records(out)  # the epochs finished before the stop, and only those
    history = client.get_metric_history(found.info.run_id, "train_loss")
    assert [(m.step, m.value) for m in history] == [(r["step"], r["train_loss"]) for r in records]
    assert not any(name.startswith("summary/") for name in found.data.metrics)
    assert job.leftovers() == []


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--tracker", "nosuch"], "Allowed: mlflow, wandb"),
        (["--metrics-port", "70000"], "must be a TCP port 1-65535, or 0 for any free one"),
    ],
)
def test_a_bad_tracker_or_port_is_one_line_and_exit_2(tmp_path, flags, said):
    result = run_cli([*TRAIN, *flags, "--output-dir", str(tmp_path / "out")], timeout_s=60)
    assert result.returncode == 2 and result.stdout == "", result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith("ddpkit train: error: ") and said in line, line
    assert not (tmp_path / "out").exists()  # refused before anything was made


def test_a_metrics_port_in_use_is_refused_before_any_worker_starts(tmp_path):
    pytest.importorskip("prometheus_client")
    out = tmp_path / "held"
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        start = time.monotonic()
        job = Job(["--epochs", "1", "--metrics-port", str(port)], out)
        try:
            code = job.finish(timeout_s=60)
        finally:
            job.kill()
        took_s = time.monotonic() - start
    assert code == 2 and job.stdout() == "", str(job)
    (line,) = job.stderr().splitlines()
    assert line == (
        f"ddpkit train: error: cannot serve metrics: port {port} on 127.0.0.1 is already in use. "
        "Pick another port (--metrics-port), or 0 to let the system pick a free one."
    )
    assert took_s < 60 and job.leftovers() == []
    assert not (out / "attempts").exists()  # no worker started
