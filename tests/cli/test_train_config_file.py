"""``ddpkit train --config FILE``: the file sets values, flags override it, mistakes in it are one
line naming the key and the file (exit 2, nothing written); ``--print-config`` writes a file
that reads back to the same settings."""

from __future__ import annotations

import pytest

from ddpkit.app.mnist.config import SECTIONS, TrainConfig
from ddpkit.settings import read_toml
from tests.helpers import run_main

FILE = """
[run]
epochs = 3
lr = 0.01
seed = 5

[step]
grad_accum = 4
precision = "bf16-mixed"

[observe]
step_timing = false
"""


def _print_config(capsys, tmp_path, *argv: str) -> TrainConfig:
    """The settings ``ddpkit train ARGV --print-config`` resolves, read back from what it prints."""
    from ddpkit.cli import main

    code = main(["train", *argv, "--print-config"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    printed = tmp_path / "printed.toml"
    printed.write_text(captured.out)
    return TrainConfig(**read_toml(printed, SECTIONS))


def test_file_values_apply_and_flags_override_them(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text(FILE)
    config = _print_config(
        capsys,
        tmp_path,
        "--config",
        str(path),
        "--grad-accum",
        "1",
        "--step-timing",
        "on",
        "--batch-size",
        "16",
    )
    expected = TrainConfig(
        epochs=3,
        lr=0.01,
        seed=5,
        grad_accum=1,
        precision="bf16-mixed",
        step_timing=True,
        batch_size=16,
    )
    assert config == expected
    # a flag given with the default's value still wins over the file
    assert _print_config(capsys, tmp_path, "--config", str(path), "--epochs", "1").epochs == 1
    assert _print_config(capsys, tmp_path, "--config", str(path)).grad_accum == 4


def test_print_config_without_flags_is_the_defaults(tmp_path, capsys):
    assert _print_config(capsys, tmp_path) == TrainConfig()


@pytest.mark.parametrize(
    "text,expected",
    [
        ("[step]\ngrad_acum = 4\n", "[step] grad_acum is not a setting"),
        ('[run]\nepochs = "3"\n', "[run] epochs='3' must be an integer"),
        ("[run]\nepochs = 0\n", "[run] epochs=0 must be >= 1"),
        ("[run\n", "config file unreadable"),
    ],
)
def test_a_bad_config_file_is_one_line_exit_2_nothing_written(tmp_path, capsys, text, expected):
    path = tmp_path / "run.toml"
    path.write_text(text)
    out = tmp_path / "out"
    code, err = run_main(["train", "--config", str(path), "--output-dir", str(out)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("ddpkit train: error: ") and expected in err and str(path) in err
    assert not out.exists()


def test_a_cross_field_rule_between_file_and_flag_is_one_line(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text("[step]\nstatic_graph = true\n")
    out = tmp_path / "out"
    argv = ["train", "--config", str(path), "--grad-accum", "2", "--output-dir", str(out)]
    code, err = run_main(argv, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "static_graph=True with grad_accum=2" in err
    assert not out.exists()
