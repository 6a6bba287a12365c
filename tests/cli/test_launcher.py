"""``ddpkit run``: really starts N ranks, names the first failure, leaves no process behind."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from ddpkit.diagnostics.failures import FailureRecord
from ddpkit.launch.launcher import LaunchSpec, summarize_failure, torchrun_argv
from ddpkit.launch.network import plan_network
from tests.helpers import pid_alive, run_cli

PROBE = str(Path(__file__).parent / "scripts" / "probe.py")
EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "train_custom.py")


def _probe_lines(output: str) -> set[str]:
    return {line for line in output.splitlines() if line.startswith("PROBE")}


@pytest.mark.slow
def test_run_starts_two_ranks_and_logs_once(tmp_path):
    result = run_cli(["-m", "ddpkit", "run", "-n", "2", PROBE, "--warn-rank", "1"])
    assert result.returncode == 0, result.output
    assert {
        "PROBE rank=0 world_size=2 local_rank=0",
        "PROBE rank=1 world_size=2 local_rank=1",
        "PROBE rank=0 sum=2",
        "PROBE rank=1 sum=2",
    } <= _probe_lines(result.stdout)
    assert result.stdout.count("info message from the probe") == 1
    assert "[rank 1/2] WARNING: warning message from rank 1" in result.stderr
    assert "[rank 0/2] WARNING" not in result.stderr


@pytest.mark.slow
def test_failure_stops_every_rank_fast_and_names_the_first(tmp_path):
    start = time.monotonic()
    result = run_cli(
        ["-m", "ddpkit", "run", "-n", "2", PROBE, "--fail-rank", "1", "--pid-dir", str(tmp_path)],
        timeout_s=90,
    )
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-6:]
    assert any("first failure: rank 1/2" in line and "ValueError: boom" in line for line in last), (
        result.stderr
    )
    assert "restarts are off" in last[-1]
    # both ranks had started (so rank 0 was stuck in the collective rank 1 never joined) ...
    pids = [int((tmp_path / f"rank{r}.pid").read_text()) for r in (0, 1)]
    # ... and ended far below the 120 s collective timeout, leaving no process behind
    assert elapsed < 60, f"took {elapsed:.1f} s"  # 11 s at load 11; a hang is the 120 s timeout
    assert not [pid for pid in pids if pid_alive(pid)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags,expected",
    [
        (
            ["--exit-rank", "1"],
            "first failure: rank 1/2 (local rank 1, pid {pid1}): SystemExit: exit status 3",
        ),
        (
            ["--kill-rank", "1", "--steps", "50"],
            "first failure: rank 1/2 died from signal SIGKILL without a Python exception.",
        ),
    ],
)
def test_exit_and_kill_name_the_rank(tmp_path, flags, expected):
    result = run_cli(
        ["-m", "ddpkit", "run", "-n", "2", PROBE, "--pid-dir", str(tmp_path), *flags], timeout_s=90
    )
    pids = [int((tmp_path / f"rank{r}.pid").read_text()) for r in (0, 1)]
    assert result.returncode == 1
    assert expected.format(pid1=pids[1]) in result.stderr, result.stderr
    assert "rank 0/2" not in result.stderr.split("first failure")[-1].splitlines()[0]
    assert not [pid for pid in pids if pid_alive(pid)]


@pytest.mark.slow
def test_workers_die_with_a_killed_launcher(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ddpkit",
            "run",
            "-n",
            "2",
            PROBE,
            "--pid-dir",
            str(tmp_path),
            "--steps",
            "100000",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("rank*.pid"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [int((tmp_path / f"rank{r}.pid").read_text()) for r in (0, 1)]
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in pids if pid_alive(pid)], "workers outlived their launcher"
    finally:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow
def test_example_runs_under_ddpkit_run_and_plain_torchrun():
    for launcher in (
        ["-m", "ddpkit", "run", "-n", "2", EXAMPLE, "--epochs", "1"],
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            EXAMPLE,
            "--epochs",
            "1",
        ],
    ):
        result = run_cli(launcher)
        assert result.returncode == 0, result.output
        assert "rank 0 of world_size 2 on cpu" in result.stdout
        assert "rank 1 of world_size 2 on cpu" in result.stdout
        assert result.stdout.count("test accuracy") == 1  # logged once, by rank 0
        assert "on 500 held-out samples" in result.stdout


def _record(
    rank: int, time_s: float, type_: str = "RuntimeError", message: str = "peer"
) -> FailureRecord:
    return FailureRecord(
        rank, rank, 2, 0, type_, message, "Traceback\n  line\n", time_s, 100 + rank
    )


def test_summary_names_the_earliest_record_not_torchruns_choice():
    # torchrun saw rank 0 (a collateral error) as its root cause; rank 1 failed first.
    records = sorted(
        [_record(0, 10.5), _record(1, 10.2, "ValueError", "boom")], key=lambda r: r.time_s
    )
    lines = summarize_failure(records, {0: 1}, LaunchSpec(["x.py"], 2))
    assert "first failure: rank 1/2" in lines[0] and "ValueError: boom" in lines[0]


def test_summary_names_a_rank_killed_by_a_signal():
    lines = summarize_failure([], {1: -9}, LaunchSpec(["x.py"], 2, max_restarts=0))
    assert lines[0] == (
        "ddpkit run: first failure: rank 1/2 died from signal SIGKILL without a Python exception."
    )


def test_summary_does_not_blame_the_rank_torchrun_terminated():
    # torchrun's report for an exit-time abort: rank 0 SIGTERM (stopped by it), rank 1 SIGABRT
    lines = summarize_failure([], {0: -15, 1: -6}, LaunchSpec(["x.py"], 2))
    assert lines[0] == (
        "ddpkit run: first failure: rank 1/2 died from signal SIGABRT without a Python exception."
    )
    assert not any("rank 0/2" in line for line in lines)


def test_torchrun_argv_passes_user_arguments_through_untouched():
    from torch.distributed import run as torchrun

    target = ["-m", "pkg.mod", "--nproc", "2", "--max", "1", "--", "x"]  # torchrun-like flags
    spec = LaunchSpec(target, 3)
    args = torchrun.parse_args(torchrun_argv(spec, plan_network(spec), "id"))
    assert args.rdzv_endpoint == "127.0.0.1:0" and args.nproc_per_node == "3" and args.module
    assert args.local_addr == "127.0.0.1" and args.rdzv_conf.startswith("is_host=false,")
    assert args.training_script == "ddpkit.launch.worker"
    assert args.training_script_args == target


def _run_spec(*flags: str) -> LaunchSpec:
    from ddpkit.cli import build_parser
    from ddpkit.cli.run import launch_spec

    argv = ["run", "-n", "1", *flags, "train.py"]
    args = build_parser().parse_args(argv)
    args.argv = argv  # as ddpkit.cli.main sets it (the stop line's resume command)
    return launch_spec(args)


def test_the_arguments_after_the_module_are_the_modules():
    from ddpkit.cli import build_parser
    from ddpkit.cli.run import launch_spec

    # docs/launching.md and `ddpkit run --help`: ddpkit run -n 2 -m mypackage.train --lr 0.1
    argv = ["run", "-n", "2", "-m", "pkg.train", "--lr", "0.1", "-n", "3"]
    args = build_parser().parse_args(argv)
    args.argv = argv
    spec = launch_spec(args)
    assert spec.nproc == 2
    assert spec.target == ["-m", "pkg.train", "--lr", "0.1", "-n", "3"]
    args = build_parser().parse_args(["run", "-n", "2", "-m", "pkg.train", "--", "--lr"])
    args.argv = []
    assert launch_spec(args).target == ["-m", "pkg.train", "--lr"]  # a leading -- is dropped


def test_a_module_in_the_current_folder_is_found_as_the_workers_will_find_it(tmp_path, monkeypatch):
    from ddpkit.launch.launcher import validate_spec

    (tmp_path / "docpkg2").mkdir()
    (tmp_path / "docpkg2" / "__init__.py").write_text("")
    (tmp_path / "docpkg2" / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)  # the console script's sys.path has its own folder, not this one
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "docpkg2", raising=False)  # removed again afterwards
    path_before = list(sys.path)
    validate_spec(LaunchSpec(["-m", "docpkg2.train"], 2))  # python -m (the workers): cwd first
    assert sys.path == path_before  # the launcher's own sys.path is left as it was


@pytest.mark.slow
def test_a_module_gets_its_arguments_on_every_rank(tmp_path):
    (tmp_path / "docpkg").mkdir()
    (tmp_path / "docpkg" / "__init__.py").write_text("")
    (tmp_path / "docpkg" / "train.py").write_text(
        "import os, sys\nprint('ARGS', os.environ['RANK'], sys.argv[1:], flush=True)\n"
    )
    # the console script, from the folder that holds the package (as torchrun -m runs it there)
    ddpkit_script = str(Path(sys.executable).parent / "ddpkit")
    result = run_cli(
        [ddpkit_script, "run", "-n", "2", "-m", "docpkg.train", "--lr", "0.1"], cwd=str(tmp_path)
    )
    assert result.returncode == 0, result.stderr
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("ARGS"))
    assert lines == ["ARGS 0 ['--lr', '0.1']", "ARGS 1 ['--lr', '0.1']"]


def test_elastic_nodes_get_restarts_and_torchrun_gets_min_max_and_the_timings():
    from torch.distributed import run as torchrun

    endpoint = ["--rdzv-endpoint", "127.0.0.1:29400"]
    assert _run_spec().max_restarts == 0 and not _run_spec().elastic
    assert _run_spec("--nnodes", "3", *endpoint).max_restarts == 0
    assert _run_spec("--nnodes", "3:3", *endpoint).max_restarts == 0  # MIN = MAX: fixed
    spec = _run_spec("--nnodes", "2:3", *endpoint, "--rdzv-conf", "last_call_timeout=5")
    assert spec.elastic and (spec.min_nodes, spec.nnodes, spec.max_restarts) == (2, 3, 3)
    assert spec.world_size == 3  # the most: what DDPKIT_MAX_WORLD_SIZE is checked against
    assert _run_spec("--nnodes", "2:3", *endpoint, "--max-restarts", "0").max_restarts == 0
    args = torchrun.parse_args(torchrun_argv(spec, plan_network(spec), "job"))
    assert args.nnodes == "2:3" and args.max_restarts == 3 and args.rdzv_id == "job"
    assert args.rdzv_conf == "is_host=false,read_timeout=10,last_call_timeout=5"


def test_elastic_world_size_limit_counts_every_node_that_may_join(monkeypatch, capsys):
    from ddpkit.cli import main

    monkeypatch.setenv("DDPKIT_MAX_WORLD_SIZE", "4")
    flags = ["--nnodes", "1:3", "--rdzv-endpoint", "127.0.0.1:29400", "-n", "2", PROBE]
    assert main(["run", *flags]) == 2
    err = capsys.readouterr().err
    assert "world_size=6, DDPKIT_MAX_WORLD_SIZE=4" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "args,expected",
    [
        (["-n", "0", "x.py"], "nproc=0 must be >= 1; script="),
        (["-n", "2", "/no/such/script.py"], "script='/no/such/script.py' does not exist"),
        (["-n", "2"], "no script given"),
        (["-n", "2", "-m", "no_such_module_xyz"], "module='no_such_module_xyz' cannot be found"),
        (["-n", "2", "-m", "no_such_xyz", "--lr", "1"], "module='no_such_xyz' cannot be found"),
        (["-n", "2", "-m"], "no script given"),
        (["-n", "2", "--omp-num-threads", "0", "/"], "omp_num_threads=0 must be >= 1"),
        (["-n", "2", "/"], "script='/' is not a file"),
        (["-n", "1", "--nnodes", "2-3", "/"], "invalid --nnodes: nnodes='2-3'. Give a number"),
        (["-n", "1", "--nnodes", "3:2", "/"], "nnodes=3:2 must be MIN:MAX with 1 <= MIN <= MAX"),
        (["-n", "1", "--nnodes", "0:2", "/"], "nnodes=0:2 must be MIN:MAX with 1 <= MIN <= MAX"),
        (["-n", "1", "--nnodes", "1:2", "/"], "several nodes need --rdzv-endpoint HOST:PORT"),
        (
            ["-n", "1", "--nnodes", "1:2", "--node-rank", "2", "--rdzv-endpoint", "h:1", "/"],
            "node_rank=2 must be in 0..1",
        ),
        (["-n", "1", "--rdzv-conf", "is_host=1", "/"], "rdzv_conf key 'is_host' is not one of"),
        (["-n", "1", "--rdzv-conf", "last_call_timeout=0", "/"], "last_call_timeout='0' must be"),
    ],
)
def test_run_rejects_bad_input_in_one_line(args, expected, capsys):
    from ddpkit.cli import main

    assert main(["run", *args]) == 2
    err = capsys.readouterr().err
    assert expected in err and len(err.strip().splitlines()) == 1


TAKEN_PORT = """
import socket, sys
import torch.distributed.elastic.rendezvous.api as rendezvous_api
from ddpkit.cli import main
taken = socket.create_server(("127.0.0.1", 0))  # another program's listener
rendezvous_api.get_free_port = lambda: taken.getsockname()[1]  # torchrun picked that port
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_port_taken_after_torchrun_picked_it_does_not_fail_the_job():
    # torchrun's agent picks the workers' MASTER_PORT by binding port 0 and closing it again;
    # another program can take it before rank 0 listens on it (a CI run, 2026-12-02: "port 38283
    # on 127.0.0.1 is already in use"). On one node ddpkit run reserves the port itself.
    result = run_cli(["-c", TAKEN_PORT, "run", "-n", "2", PROBE], timeout_s=90)
    assert result.returncode == 0, result.output
    assert {"PROBE rank=0 sum=2", "PROBE rank=1 sum=2"} <= _probe_lines(result.stdout)


def test_several_nodes_keep_torchruns_port_even_inside_another_job(monkeypatch):
    from ddpkit.launch.launcher import _reserve_master_port
    from ddpkit.security.bind import MASTER_PORT_ENV

    monkeypatch.setenv(MASTER_PORT_ENV, "9")  # inherited: a launcher started inside a worker
    two = LaunchSpec(target=[PROBE], nproc=1, nnodes=2, rdzv_endpoint="127.0.0.1:29400")
    assert _reserve_master_port(two, plan_network(two)) is None
    assert MASTER_PORT_ENV not in os.environ
    one = LaunchSpec(target=[PROBE], nproc=2)
    reserved = _reserve_master_port(one, plan_network(one))
    try:
        assert os.environ[MASTER_PORT_ENV] == str(reserved.getsockname()[1]) != "9"
    finally:
        reserved.close()


@pytest.mark.slow
def test_a_rank_that_ends_normally_mid_job_is_named_as_the_cause():
    # rank 1 ends its script (exit 0) while rank 0 waits in an all-reduce: no rank failed,
    # the ranks made different numbers of collective calls (uneven batches, a rank-0-only call)
    result = run_cli(
        ["-m", "ddpkit", "run", "-n", "2", PROBE, "--finish-rank", "1", "--steps", "5"]
    )
    assert result.returncode == 1, result.output
    assert (
        "ddpkit run: hint: rank 1 ran its script to the end (exit status 0) while rank 0 was "
        "still in all_reduce of float64 (1,) at tests/cli/scripts/probe.py:"
    ) in result.stderr, result.stderr
    assert (
        "The first failure in the other ranks' output is the cause"
        not in result.stderr.split("hint:", 1)[1]
    )
