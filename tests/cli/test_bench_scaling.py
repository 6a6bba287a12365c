"""``ddpkit bench scaling``: one row per process count, efficiency = thr(n) / (n * thr(1))."""

from __future__ import annotations

import json

import pytest

from ddpkit.bench import scaling
from tests.helpers import run_cli, run_main


@pytest.mark.slow
def test_one_and_two_processes_give_rows_with_weak_scaling_efficiency(tmp_path):
    table = tmp_path / "scaling.csv"
    args = ["-m", "ddpkit", "bench", "scaling", "--max-nproc", "2", "--rounds", "1"]
    done = run_cli([*args, "--steps", "4", "--warmup", "1", "--json", "--csv", str(table)], 150)
    assert done.returncode == 0, done.output
    report = json.loads(done.stdout)
    rows = report["rows"]
    assert [row["nproc"] for row in rows] == [1, 2]
    one = rows[0]["samples_per_s"]
    for row in rows:
        assert row["samples_per_s"] > 0
        assert row["samples_per_s_per_round"] == [row["samples_per_s"]]
        expected = row["samples_per_s"] / (row["nproc"] * one)
        assert row["efficiency"] == pytest.approx(expected, rel=1e-12)
        assert row["samples_per_s_per_rank"] == pytest.approx(row["samples_per_s"] / row["nproc"])
    assert rows[0]["efficiency"] == 1.0
    assert report["settings"]["form"] == "ddpkit" and report["settings"]["omp_num_threads"] >= 1
    assert table.read_text().splitlines()[0].startswith("nproc,samples_per_s,")


def test_efficiency_uses_the_median_of_each_process_count():
    rows = scaling.scaling_rows({1: [100.0, 300.0, 200.0], 2: [300.0, 360.0, 100.0]})
    assert [row["samples_per_s"] for row in rows] == [200.0, 300.0]
    assert [row["efficiency"] for row in rows] == [1.0, 0.75]


@pytest.mark.parametrize(
    "extra,expected",
    [
        (["--form", "accelerate"], "--form 'accelerate' is not one of ddpkit, raw_ddp"),
        (["--max-nproc", "0", "--warmup", "-1"], "--max-nproc 0 must be >= 1; --warmup -1"),
        (["--rounds", "0"], "--rounds 0 must be >= 1"),
        (["--data-dir", "{tmp}/no-such-dir"], "data dir not found"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, extra, expected):
    argv = ["bench", "scaling", *[e.format(tmp=tmp_path) for e in extra]]
    code, err = run_main(argv, capsys)
    assert code == 2
    assert expected in err
    assert len(err.strip().splitlines()) == 1, err


def test_more_processes_than_cores_gets_a_note_on_stderr(capsys, monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    runs = []

    def fake_run_form(form, nproc, settings):
        runs.append(nproc)
        return {"samples_per_s": 100.0 * nproc}

    monkeypatch.setattr(scaling.steploop, "run_form", fake_run_form)
    code = scaling.run(_args(max_nproc=3))
    err = capsys.readouterr().err
    assert code == 0 and sorted(runs) == [1, 2, 3]
    assert "note: 3 processes on 2 CPU cores: from 3 processes on, ranks share cores" in err
    code = scaling.run(_args(max_nproc=2))
    assert code == 0 and "note:" not in capsys.readouterr().err


def _args(max_nproc: int):
    import argparse

    parser = argparse.ArgumentParser()
    scaling.add_arguments(parser)
    return parser.parse_args(["--max-nproc", str(max_nproc), "--rounds", "1", "--json"])
