"""``bash bench/gpu_check.sh``: the GPU check is known to work before a GPU is spent on it.

The dry run (``--cpu-dry-run``) runs every run of the check for real on the CPU (gloo, 30 steps,
one thread per process) and must print one table in which every run succeeded, trained, and
says what it substituted; without ``--cpu-dry-run`` a machine without CUDA gets one line and
exit status 2. The plan for a real GPU is checked without one.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, SHARED_MNIST
from tests.helpers import Completed, run_cli

SCRIPT = REPO / "bench" / "gpu_check.sh"
RUNS = ["fp32", "bf16", "compile", "fsdp", "nccl", "raw_torch"]


def run_script(args: list[str], timeout_s: float) -> Completed:
    """``bash bench/gpu_check.sh ARGS`` in a session of its own; on timeout the whole group is
    killed (the script kills its own runs' process trees on their timeouts)."""
    env = {"OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
    return run_cli([str(SCRIPT), *args], timeout_s, env=env, program=["bash"])


def load_gpu_check():
    """bench/gpu_check.py as a module (bench/ is no package); its dataclasses need it in
    sys.modules while it runs."""
    name = "bench_gpu_check"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "bench" / "gpu_check.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_2():
    done = run_script([], timeout_s=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert "no CUDA GPU" in lines[0] and "--cpu-dry-run" in lines[0]


def test_on_one_gpu_fsdp_moves_to_the_cpu_and_says_why():
    gpu_check = load_gpu_check()
    one = {run.name: run for run in gpu_check.plan_runs(dry_run=False, num_gpus=1)}
    assert list(one) == RUNS
    assert one["fp32"].flags == ["--nproc", "1"] and one["fp32"].device == "cuda"
    assert "--precision" in one["bf16"].flags and "bf16-mixed" in one["bf16"].flags
    assert "--compile" in one["compile"].flags
    assert one["nccl"].flags == ["--nproc", "1", "--backend", "nccl"]
    fsdp = one["fsdp"]
    assert fsdp.flags == ["--nproc", "2", "--strategy", "fsdp", "--backend", "gloo"]
    assert fsdp.device == "cpu" and "fsdp needs 2 processes" in " ".join(fsdp.substituted)
    assert all(not one[name].substituted for name in RUNS if name != "fsdp")
    two = {run.name: run for run in gpu_check.plan_runs(dry_run=False, num_gpus=2)}
    assert two["fsdp"].flags[-2:] == ["--backend", "nccl"] and two["fsdp"].device == "cuda"
    assert two["nccl"].flags == ["--nproc", "2", "--backend", "nccl"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_cpu_dry_run_runs_every_run_and_prints_one_table(tmp_path):
    if (SHARED_MNIST / "train-images-idx3-ubyte.gz").is_file():
        data, floor = ["--data-dir", str(SHARED_MNIST)], 0.6  # 30 steps reach about 0.89
    else:
        data, floor = ["--dataset", "digits"], 0.4  # one pass, 23 steps: about 0.7
    report_path = tmp_path / "gpu_check.json"
    args = ["--cpu-dry-run", *data, "--json", str(report_path), "--out", str(tmp_path / "runs")]
    done = run_script(args, timeout_s=360)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(report_path.read_text())
    rows = {row["run"]: row for row in report["rows"]}
    assert list(rows) == RUNS and report["ok"] is True
    assert report["settings"]["mode"] == "cpu-dry-run" and report["settings"]["steps"] == 30
    for name, row in rows.items():
        assert row["exit"] == 0, row
        assert row["test_accuracy"] > floor, row
        assert row["samples_per_s"] > 0 and row["peak_memory_mb"] > 0, row
        assert row["ratio_to_raw"] == pytest.approx(  # the report rounds it to 3 decimals
            row["samples_per_s"] / rows["raw_torch"]["samples_per_s"], rel=1e-2, abs=5e-4
        )
        assert "cuda -> cpu" in row["substituted"], row
        if name != "raw_torch":
            assert any(s.startswith("nccl -> gloo") for s in row["substituted"]), row
            assert (tmp_path / "runs" / name / "summary.json").is_file()
    assert "--precision bf16-mixed" in rows["bf16"]["settings"]  # bf16 autocast runs on CPU
    assert "--compile" in rows["compile"]["settings"]
    assert "world size 2, process group gloo" in rows["fsdp"]["settings"]
    assert "world size 1, process group none" in rows["nccl"]["settings"]
    table = [line for line in done.stdout.splitlines() if line.startswith("|")]
    assert len(table) == 2 + len(RUNS) and table[0].startswith("| run | settings | substituted")
    for name, line in zip(RUNS, table[2:], strict=True):
        assert line.startswith(f"| {name} |") and "cuda -> cpu" in line
    assert "all runs succeeded" in done.stdout
    assert Path(REPO / "bench" / "gpu_check.sh").stat().st_mode & 0o111  # runnable as ./
