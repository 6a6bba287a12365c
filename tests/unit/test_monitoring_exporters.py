"""The exporters with the real libraries, offline: the Prometheus endpoint scraped over HTTP,
MLflow's local store read back with its own client, a W&B offline run read from its file.

Ports: always 0 (the system picks) or a port this test holds. W&B runs in a child process
whose network is a trap (``WANDB_BASE_URL`` and the proxies point at a socket that never
answers): the test fails if anything connected to it, up to and including the child's exit.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ddpkit.errors import ConfigError
from ddpkit.monitoring.prometheus import MetricsServer
from ddpkit.monitoring.trackers import open_trackers
from ddpkit.security.bind import local_address_towards

PHASES = {"data": 0.002, "compute": 0.0205, "comm_wait": 0.004, "step": 0.031}


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels): value}`` of a scrape, parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def key(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return name, tuple(sorted(labels.items()))


def refused(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


# --- Prometheus ------------------------------------------------------------------------------

# each test is skipped, with the reason, only when the library it exercises is missing
needs_prometheus = pytest.mark.skipif(
    importlib.util.find_spec("prometheus_client") is None,
    reason="prometheus_client is not installed",
)


@needs_prometheus
def test_a_scrape_shows_each_ranks_values_with_their_labels():
    with MetricsServer(0) as server:
        assert server.url == f"http://127.0.0.1:{server.port}/metrics" and server.port > 0
        server.update_rank(
            0, "node-a", step=120, samples_per_s=5400.5, phases=PHASES, last_step_time=1.7e9
        )
        server.update_rank(
            1, "node-b", step=119, samples_per_s=None, phases={"data": 0.25}, last_step_time=1.6e9
        )
        server.set_goodput(0.93)
        server.count_event("nonfinite_skip")
        server.count_event("straggler", 2)
        server.set_straggler(1, "node-b", phase="data", on=True)
        server.set_straggler(0, "node-a", phase="data", on=False)
        got = samples(scrape(server.url))

    a, b = {"rank": "0", "host": "node-a"}, {"rank": "1", "host": "node-b"}
    assert got[key("ddpkit_step", **a)] == 120 and got[key("ddpkit_step", **b)] == 119
    assert got[key("ddpkit_samples_per_second", **a)] == 5400.5
    assert key("ddpkit_samples_per_second", **b) not in got  # None: not measured, not exported
    for phase, seconds in PHASES.items():
        assert got[key("ddpkit_step_phase_seconds", **a, phase=phase)] == seconds
    assert got[key("ddpkit_step_phase_seconds", **b, phase="data")] == 0.25
    assert key("ddpkit_step_phase_seconds", **b, phase="step") not in got
    assert got[key("ddpkit_last_step_timestamp_seconds", **a)] == 1.7e9
    assert got[key("ddpkit_last_step_timestamp_seconds", **b)] == 1.6e9
    assert got[key("ddpkit_goodput_ratio")] == 0.93
    assert got[key("ddpkit_guard_events_total", kind="nonfinite_skip")] == 1
    assert got[key("ddpkit_guard_events_total", kind="straggler")] == 2
    assert got[key("ddpkit_guard_events_total", kind="replica_mismatch")] == 0
    assert got[key("ddpkit_straggler", **b, phase="data")] == 1
    assert got[key("ddpkit_straggler", **a, phase="data")] == 0


@needs_prometheus
def test_goodput_is_nan_until_known_and_bad_values_are_refused():
    with MetricsServer(0) as server:
        assert math.isnan(samples(scrape(server.url))[key("ddpkit_goodput_ratio")])
        with pytest.raises(ValueError, match="ratio=93"):
            server.set_goodput(93)  # a percentage
        with pytest.raises(ValueError, match=r"phases=\['fwd'\]. Allowed: data, compute"):
            server.update_rank(
                0, "h", step=1, samples_per_s=1.0, phases={"fwd": 1.0}, last_step_time=0.0
            )
        with pytest.raises(ValueError, match="n=-1"):
            server.count_event("straggler", -1)


@needs_prometheus
def test_a_port_in_use_is_refused_naming_it_and_the_fix():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(ConfigError) as caught:
            MetricsServer(port)
    message = str(caught.value)
    assert f"port {port} on 127.0.0.1 is already in use" in message
    assert "--metrics-port" in message and "or 0" in message and "\n" not in message


@needs_prometheus
def test_close_frees_the_port_and_is_idempotent():
    first = MetricsServer(0)
    port = first.port
    first.close()
    first.close()
    with pytest.raises(urllib.error.URLError):
        scrape(first.url)
    with MetricsServer(port) as second:  # the same port binds again at once
        assert "ddpkit_step" in scrape(second.url)


@needs_prometheus
def test_it_listens_on_loopback_only_unless_an_address_is_given():
    with MetricsServer(0) as server:
        assert server.host == "127.0.0.1"
        assert refused("127.0.0.2", server.port)  # one address, not the whole machine
    with MetricsServer(0, host="127.0.0.2") as server:
        assert "ddpkit_goodput_ratio" in scrape(server.url)
        assert refused("127.0.0.1", server.port)
    with pytest.raises(ConfigError, match="unspecified address"):
        MetricsServer(0, host="0.0.0.0")


@needs_prometheus
def test_a_non_loopback_address_is_used_only_when_given():
    try:
        address = local_address_towards("192.0.2.1", 9)  # TEST-NET-1: a UDP connect, no packet
    except OSError:
        pytest.skip("this machine has no route off loopback")
    if address.startswith("127."):
        pytest.skip("this machine has no non-loopback address")
    with MetricsServer(0) as server:
        assert refused(address, server.port)
    with MetricsServer(0, host=address) as server:
        assert server.url == f"http://{address}:{server.port}/metrics"
        assert "ddpkit_step" in scrape(server.url)
        assert refused("127.0.0.1", server.port)


# --- trackers --------------------------------------------------------------------------------

CONFIG = {"lr": 0.1, "epochs": 2, "strategy": "ddp", "model": {"hidden": 128}, "note": "x" * 7000}
EPOCHS = [({"train_loss": 0.5, "test_accuracy": 0.9}, 1), ({"train_loss": 0.25}, 2)]
SUMMARY = {"test_accuracy": 0.95, "wall_s": 12.5, "best": {"epoch": 2}, "outcome": "completed"}


@pytest.fixture
def no_tracker_env(monkeypatch):
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)


def test_unknown_and_missing_trackers_are_one_line_errors(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"tracker=tensorboard,neptune. Allowed: mlflow, wandb"):
        open_trackers(["mlflow", "tensorboard", "neptune"], tmp_path, run_name="r", config={})
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now fails
    with pytest.raises(ConfigError, match=r"pip install 'ddpkit\[wandb\]'") as caught:
        open_trackers(["wandb"], tmp_path, run_name="r", config={})
    assert "\n" not in str(caught.value)
    with open_trackers([], tmp_path, run_name="r", config={}) as nothing:
        nothing.log_metrics({"x": 1.0}, step=1)
        assert nothing.names == ()
    with pytest.raises(ValueError, match="status='DONE'"):
        nothing.close("DONE")


@pytest.mark.slow  # MLflow's SQLite store (its migrations): several seconds, out of the inner loop
def test_mlflow_local_store_holds_config_epochs_and_summary(tmp_path, no_tracker_env):
    mlflow = pytest.importorskip("mlflow", reason="mlflow is not installed")
    trackers = open_trackers(["mlflow"], tmp_path, run_name="run-1", config=CONFIG)
    for metrics, step in EPOCHS:
        trackers.log_metrics(metrics, step=step)
    trackers.log_summary(SUMMARY)
    trackers.close()
    trackers.close()  # idempotent

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.get_experiment_by_name("ddpkit")
    assert experiment.artifact_location == str(tmp_path / "mlartifacts")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "run-1"
    assert run.data.params == {
        "lr": "0.1",
        "epochs": "2",
        "strategy": "ddp",
        "model.hidden": "128",
        "note": "x" * 6000,
    }
    history = client.get_metric_history(run.info.run_id, "train_loss")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.25)]
    assert run.data.metrics["summary/test_accuracy"] == 0.95
    assert run.data.metrics["summary/best.epoch"] == 2
    assert "summary/outcome" not in run.data.metrics  # text: in summary.json only
    saved = client.download_artifacts(run.info.run_id, "summary.json", str(tmp_path / "dl"))
    assert json.loads(Path(saved).read_text()) == SUMMARY
    assert trackers.locations["mlflow"].startswith(f"sqlite:///{tmp_path}/mlflow.db")


@pytest.mark.slow  # MLflow's SQLite store (its migrations): several seconds, out of the inner loop
def test_mlflow_takes_non_finite_values_and_the_users_tracking_uri(
    tmp_path, no_tracker_env, monkeypatch
):
    mlflow = pytest.importorskip("mlflow", reason="mlflow is not installed")
    uri = f"sqlite:///{tmp_path}/elsewhere.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root for that store: ./mlruns
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "mine")
    with pytest.raises(RuntimeError, match="diverged"):
        with open_trackers(["mlflow"], tmp_path / "out", run_name="r", config={}) as trackers:
            trackers.log_metrics({"loss": math.nan, "grad_norm": math.inf}, step=1)
            trackers.log_summary({"loss": math.nan, "peak": -math.inf})
            raise RuntimeError("diverged")

    assert not (tmp_path / "out" / "mlflow.db").exists()
    client = mlflow.MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("mine").experiment_id])
    assert run.info.status == "FAILED"
    assert run.info.artifact_uri.startswith(str(tmp_path / "mlruns"))  # MLflow's choice, kept
    assert math.isnan(run.data.metrics["loss"])
    assert run.data.metrics["grad_norm"] == sys.float_info.max  # MLflow's SQL store's inf
    saved = client.download_artifacts(run.info.run_id, "summary.json", str(tmp_path / "dl"))
    strict = json.loads(Path(saved).read_text(), parse_constant=pytest.fail)
    assert strict == {"loss": "nan", "peak": "-inf"}


WANDB_CHILD = textwrap.dedent(
    """
    import math, sys
    from pathlib import Path
    from ddpkit.monitoring.trackers import open_trackers
    config = {"lr": 0.1, "epochs": 2, "model": {"hidden": 128}}
    trackers = open_trackers(["wandb"], Path(sys.argv[1]), run_name="run-1", config=config)
    trackers.log_metrics({"train_loss": 0.5, "test_accuracy": 0.9}, step=1)
    trackers.log_metrics({"train_loss": 0.25, "grad_norm": math.inf}, step=2)
    trackers.log_summary({"test_accuracy": 0.95, "train_loss": 0.2, "loss": math.nan,
                          "best": {"epoch": 2}})
    trackers.close()
    print(trackers.locations["wandb"], file=sys.stderr)
    """
)


def read_wandb_records(path: Path) -> list:
    """The protobuf records of a ``.wandb`` file (LevelDB log format: 32 KiB blocks of
    ``crc32 | length (2, little endian) | type | data`` chunks after a 7-byte ``:W&B`` header).
    wandb 0.31 ships no Python reader of its own."""
    from wandb.proto import wandb_internal_pb2

    data, block, header = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B"
    records, pending, pos = [], b"", header
    while pos + header <= len(data):
        if block - pos % block < header:  # the tail of a block too short for a header: zeros
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        pending += data[pos + header : pos + header + length]
        pos += header + length
        if kind in (1, 4):  # FULL, or LAST of FIRST/MIDDLE/LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def items(updates) -> dict:
    """``{key: value}`` of W&B's history/summary/config items (keys nested as a list there)."""
    return {i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in updates}


@pytest.mark.slow
def test_wandb_offline_run_holds_config_epochs_and_summary_and_touches_no_network(tmp_path):
    pytest.importorskip("wandb", reason="wandb is not installed")
    with socket.socket() as trap:
        trap.bind(("127.0.0.1", 0))
        trap.listen(16)
        trap.setblocking(False)
        url = f"http://127.0.0.1:{trap.getsockname()[1]}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
        env.update(
            WANDB_BASE_URL=url,
            HTTP_PROXY=url,
            HTTPS_PROXY=url,
            http_proxy=url,
            https_proxy=url,
            WANDB_DISABLE_CODE="true",
            WANDB_DIR=str(tmp_path),
            WANDB_CONFIG_DIR=str(tmp_path / "config"),
            WANDB_CACHE_DIR=str(tmp_path / "cache"),
            WANDB_DATA_DIR=str(tmp_path / "data"),
        )
        env.pop("NO_PROXY", None)
        env.pop("no_proxy", None)
        child = subprocess.run(
            [sys.executable, "-c", WANDB_CHILD, str(tmp_path / "out")],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert child.returncode == 0, child.stderr
        with pytest.raises(BlockingIOError):  # nothing connected, exit included
            trap.accept()
    assert child.stdout == ""  # silent: a training job's output stays its own

    (run_dir,) = (tmp_path / "out" / "wandb").glob("offline-run-*")
    assert child.stderr.strip() == str(run_dir)
    (run_file,) = run_dir.glob("run-*.wandb")
    records = read_wandb_records(run_file)
    (run,) = [r.run for r in records if r.HasField("run")]
    assert run.display_name == "run-1" and run.project == "ddpkit"
    config = items(run.config.update)
    assert config["lr"] == 0.1 and config["model"] == {"hidden": 128}
    history = [items(r.history.item) for r in records if r.HasField("history")]
    assert [h["_step"] for h in history] == [1, 2]
    assert history[0]["test_accuracy"] == 0.9 and history[1]["train_loss"] == 0.25
    assert math.isinf(history[1]["grad_norm"])
    summary = {}
    for record in records:  # in order: later updates win, as in W&B
        if record.HasField("summary"):
            summary.update(items(record.summary.update))
    assert summary["test_accuracy"] == 0.95
    assert summary["train_loss"] == 0.2  # the summary's, not the last step's 0.25
    assert summary["loss"] == "nan" and summary["best"] == {"epoch": 2}
    (exit_record,) = [r.exit for r in records if r.HasField("exit")]
    assert exit_record.exit_code == 0
