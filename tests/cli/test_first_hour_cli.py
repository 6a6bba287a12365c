"""A new user's first hour (issue 16): help texts, labels, paths and refusals, one process."""

from __future__ import annotations

import ast
import inspect

import pytest

from ddpkit.cli import main
from tests.helpers import run_main


@pytest.mark.parametrize(
    "benchmark,example",
    [
        ("overhead", "    ddpkit bench overhead --compression fp16 --json"),
        ("scaling", "    ddpkit bench scaling --max-nproc 4 --form raw_ddp --json"),
        (
            "allreduce",
            "    ddpkit bench allreduce --nproc 3 -b 1M -e 64M --csv ar.csv --json ar.json",
        ),
    ],
)
def test_bench_help_keeps_its_lines_without_markup(capsys, benchmark, example):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", benchmark, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert example in out.splitlines(), out  # each example on its own line
    assert "``" not in out and ":mod:" not in out and ":func:" not in out, out


def test_allreduce_add_arguments_is_under_60_lines():
    from ddpkit.bench import allreduce

    node = ast.parse(inspect.getsource(allreduce.add_arguments)).body[0]
    assert node.end_lineno - node.lineno + 1 < 60


def test_output_dir_that_cannot_be_created_is_one_line(capsys):
    # /proc accepts no new folders even for root, whose os.access says yes
    code, err = run_main(["train", "--dataset", "digits", "--output-dir", "/proc/x/y"], capsys)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("ddpkit train: error: cannot create the output folder: --output-dir")


def _no_workers(args):  # stands in for torchrun: a refused launch must never get here
    raise AssertionError("workers were started")


def test_nproc_beyond_memory_is_refused_before_any_worker(tmp_path, capsys, monkeypatch):
    pytest.importorskip("sklearn")
    monkeypatch.setattr("ddpkit.launch.resources.available_memory_bytes", lambda: 8 * 2**30)
    monkeypatch.setattr("torch.distributed.run.run", _no_workers)
    argv = ["train", "--dataset", "digits", "--nproc", "64", "--output-dir", str(tmp_path / "o")]
    code, err = run_main(argv, capsys)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("ddpkit train: error: --nproc 64 does not fit in memory: 64 ranks x")
    assert "290 MiB each (a ddpkit train rank on digits" in err  # the measured figure
    assert "at most 28 fit: use --nproc 28 or fewer" in err  # 8 GiB // 290 MiB


def test_nproc_beyond_cores_warns_in_one_line(tmp_path, capsys, monkeypatch):
    script = tmp_path / "noop.py"
    script.write_text("pass\n")
    monkeypatch.setattr("ddpkit.launch.resources.available_memory_bytes", lambda: 64 * 2**30)
    monkeypatch.setattr("ddpkit.launch.resources.usable_cores", lambda: 2)
    monkeypatch.setattr("torch.distributed.run.run", lambda args: None)  # no workers needed
    code, err = run_main(["run", "-n", "3", str(script)], capsys)
    assert code == 0, err
    assert err.strip().splitlines() == [
        "ddpkit run: warning: --nproc 3 processes on 2 usable cores: they take turns on the "
        "cores (1 thread each), so the job runs no faster than with --nproc 2."
    ]


def test_memory_check_names_the_largest_count_that_fits():
    from ddpkit.errors import ConfigError
    from ddpkit.launch.resources import check_fits

    gib = 2**30
    with pytest.raises(ConfigError, match=r"64 ranks x about 730 MiB .* at most 33 fit"):
        check_fits(64, mem_per_rank_mib=730, available_bytes=24 * gib, cores=2)
    assert check_fits(2, mem_per_rank_mib=730, available_bytes=24 * gib, cores=2) is None
    with pytest.raises(ConfigError, match="at most 0 fit: free memory first"):
        check_fits(1, mem_per_rank_mib=730, available_bytes=gib // 2, cores=2)
