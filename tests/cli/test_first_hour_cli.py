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
