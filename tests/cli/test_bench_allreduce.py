"""``ddpkit bench allreduce``: a real sweep on 2 and 3 gloo ranks whose rows obey the nccl-tests
formulas, identical CSV and JSON, and bad input refused in one line with exit status 2."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from ddpkit.bench.allreduce import run_ranks
from ddpkit.errors import DistributedError
from tests.helpers import run_cli, run_main

FLOATS = ("time_us", "algbw_gbps", "busbw_gbps", "busbw_frac_memcpy")


def _csv_rows(path) -> list[dict]:
    with open(path, newline="") as handle:
        return [
            {key: float(value) if key in FLOATS else int(value) for key, value in row.items()}
            for row in csv.DictReader(handle)
        ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc,max_bytes,extra,expected_repeats",
    [
        (2, "64K", [], 3),  # 3 ms-scale ops fit the default 2 s budget: every repeat runs
        (3, "16KiB", ["--iters", "6", "--budget-s", "1e-6"], 3),  # budget cuts 6 to the minimum 3
    ],
)
def test_sweep_rows_follow_the_nccl_tests_formulas(
    tmp_path, nproc, max_bytes, extra, expected_repeats
):
    csv_path, json_path = tmp_path / "ar.csv", tmp_path / "out" / "ar.json"
    result = run_cli(
        ["-m", "ddpkit", "bench", "allreduce", "--nproc", str(nproc), "--min-bytes", "4K"]
        + ["--max-bytes", max_bytes, "--iters", "3", "--csv", str(csv_path)]
        + ["--json", str(json_path), *extra],
        timeout_s=90,
    )
    assert result.returncode == 0, result.output
    report = json.loads(json_path.read_text())
    rows = report["rows"]
    expected_sizes = [4096 * 2**i for i in range(5 if max_bytes == "64K" else 3)]
    assert [row["bytes"] for row in rows] == expected_sizes
    assert report["world_size"] == nproc and report["backend"] == "gloo"
    assert report["dtype"] == "float32" and report["machine"]["torch"] == torch.__version__
    memcpy = report["memcpy_gbps"]
    assert memcpy > 0 and report["memcpy_device"] == "cpu"
    assert report["memcpy_bytes"] == expected_sizes[-1]
    for row in rows:
        time_s = row["time_us"] / 1e6
        assert time_s > 0 and row["elements"] == row["bytes"] // 4
        assert row["repeats"] == expected_repeats
        assert row["algbw_gbps"] == pytest.approx(row["bytes"] / time_s / 1e9, rel=1e-12)
        assert row["busbw_gbps"] == pytest.approx(
            row["algbw_gbps"] * 2 * (nproc - 1) / nproc, rel=1e-12
        )
        assert row["busbw_frac_memcpy"] == pytest.approx(row["busbw_gbps"] / memcpy, rel=1e-12)
    assert _csv_rows(csv_path) == rows
    lines = result.stdout.splitlines()
    assert lines[0].startswith("machine: ") and f"torch {torch.__version__}" in lines[0]
    assert lines[1].startswith(f"world size {nproc}, backend gloo, dtype float32; memory copy")
    assert lines[2].split() == ["bytes", "elements", "repeats", "time", "us", "algbw", "GB/s"] + [
        "busbw",
        "GB/s",
        "busbw/memcpy",
    ]
    assert [int(line.split()[0]) for line in lines[3:-1]] == expected_sizes
    assert lines[-1].startswith("busbw/memcpy: ") and "above 1 is possible" in lines[-1]


@pytest.mark.parametrize(
    "flags,expected",
    [
        (["-b", "1M", "-e", "4K"], "--min-bytes 1M is above --max-bytes 4K"),
        (["-b", "4X"], "--min-bytes '4X' is not a size"),
        (["-e", "lots"], "--max-bytes 'lots' is not a size"),
        (["-f", "1"], "--factor 1 must be >= 2"),
        (["--nproc", "1"], "--nproc 1 must be >= 2 (an all-reduce over one rank moves no data"),
        (["--iters", "0"], "--iters 0 >= 1"),
        (["--timeout", "-1"], "--timeout -1.0 must be a finite number of seconds > 0"),
        (["--dtype", "float16", "-b", "3"], "--min-bytes 3 is not a whole number of float16"),
        (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
        (["--nproc", "1", "-f", "0"], "--nproc 1 must be >= 2 (an all-reduce over one rank"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, flags, expected):
    out = tmp_path / "ar.json"
    code, err = run_main(["bench", "allreduce", *flags, "--json", str(out)], capsys)
    assert code == 2
    assert expected in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    assert not out.exists()


def test_every_problem_is_listed_in_the_one_line(capsys):
    code, err = run_main(["bench", "allreduce", "--nproc", "1", "-f", "1", "-b", "x"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--min-bytes 'x'" in err and "--nproc 1" in err and "--factor 1" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine could run nccl")
def test_nccl_without_gpus_is_refused(capsys):
    code, err = run_main(["bench", "allreduce", "--backend", "nccl"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "backend=nccl needs one CUDA device per local rank" in err and "found 0 device" in err


@pytest.mark.slow
def test_a_failing_worker_stops_every_rank_with_one_line():
    plan = {"sizes": [4096], "dtype": "float64", "warmup": 0, "iters": 1, "budget_s": 1.0}
    plan["backend"] = "gloo"  # float64 is not in DTYPES: every rank raises KeyError
    with pytest.raises(DistributedError) as info:
        run_ranks(plan, world_size=2, timeout_s=60)
    message = str(info.value)
    assert len(message.splitlines()) == 1, message
    assert message.startswith("all-reduce benchmark failed, every rank stopped: rank ")
    assert "raised: KeyError: 'float64'" in message


@pytest.mark.slow
def test_ranks_past_the_timeout_are_stopped_with_one_line_exit_1(tmp_path, capsys):
    out = tmp_path / "ar.json"
    # the sweep 8 KiB .. 64 MiB takes seconds on two CPU ranks, far past the 0.5 s limit
    argv = ["bench", "allreduce", "-b", "8K", "-e", "64M", "--timeout", "0.5", "--json", str(out)]
    code, err = run_main(argv, capsys)
    assert code == 1, err
    assert len(err.strip().splitlines()) == 1, err
    assert "all-reduce benchmark failed, every rank stopped: timed out after 0.5 s" in err
    assert "ranks still running: [0, 1]" in err and not out.exists()
