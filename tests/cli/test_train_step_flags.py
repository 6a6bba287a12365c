"""``ddpkit train``'s training-step flags: listed with meaning and unit, bad values refused."""

from __future__ import annotations

import pytest

from ddpkit.cli import main
from tests.helpers import run_main


@pytest.mark.parametrize(
    "extra,expected",
    [
        (["--grad-accum", "0"], "grad_accum=0 must be >= 1"),
        (["--clip-grad-norm", "-1"], "clip_grad_norm=-1.0 must be a finite number >= 0"),
        (["--clip-grad-norm", "nan"], "clip_grad_norm=nan must be a finite number >= 0"),
        (["--precision", "8"], "argument --precision: invalid choice: '8'"),
        (
            ["--static-graph", "--grad-accum", "2"],
            "static_graph=True with grad_accum=2. torch's DDP breaks no_sync",
        ),
        (
            ["--precision", "16-mixed", "--on-nonfinite", "skip"],
            "precision='16-mixed' with on_nonfinite='skip'. The loss scaler already skips",
        ),
    ],
)
def test_bad_step_flags_are_one_line_exit_2(tmp_path, capsys, extra, expected):
    out = tmp_path / "out"
    code, err = run_main(["train", "--dataset", "digits", "--output-dir", str(out), *extra], capsys)
    assert code == 2
    assert expected in err
    assert len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_help_lists_the_step_flags_with_meaning(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for expected in (
        "--grad-accum K micro-batches per optimizer step (default 1)",
        "--precision {32,bf16-mixed,16-mixed}",
        "--clip-grad-norm X clip the total L2 norm of the unscaled gradients",
        "--find-unused-parameters",
        "--static-graph",
        "--join",
    ):
        assert expected in text
