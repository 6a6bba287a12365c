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


ONE_EPOCH = [
    {
        "epoch": 1,
        "step": 469,
        "train_loss": 0.21,
        "test_loss": 0.05,
        "test_accuracy": 0.9884,
        "samples_per_s": 1510.0,
        "data_s_per_step": 0.001,
        "forward_s_per_step": 0.01,
    }
]
STEPS = [
    {"step": s, "epoch": 1, "loss": 2.3 / s**0.5, "samples_per_s": 1500.0 + s, "lr": 0.001}
    for s in range(50, 469, 50)
]


def _drawn(name: str, epochs: list[dict], steps: list[dict]):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from ddpkit.cli.plot import draw_plot

    fig, ax = plt.subplots()
    draw_plot(ax, name, epochs, steps)
    lines = [line.get_xdata() for line in ax.lines]
    texts = [text.get_text() for text in ax.texts]
    xlim = ax.get_xlim()
    plt.close(fig)
    return lines, texts, xlim


def test_plot_of_one_epoch_draws_the_steps_and_labels_lone_points():
    for name in ("loss.png", "throughput.png"):
        lines, texts, xlim = _drawn(name, ONE_EPOCH, STEPS)
        assert max(len(x) for x in lines) == len(STEPS), name  # a curve over the step records
        assert xlim[0] == 0, name  # the epoch axis starts where training did
    lines, texts, _ = _drawn("accuracy.png", ONE_EPOCH, STEPS)
    assert "0.9884" in texts  # one value: written, not a bare dot
    _, texts, _ = _drawn("loss.png", ONE_EPOCH, [])
    assert "0.2100" in texts and "0.0500" in texts
