"""``ddpkit plot`` draws ranks.png from ranks.jsonl: one line per rank, the straggler on top."""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_main

EPOCH = {
    "epoch": 1,
    "train_loss": 0.5,
    "test_loss": 0.4,
    "test_accuracy": 0.9,
    "samples_per_s": 1000.0,
    "step": 40,
}


def _rank(step: int, rank: int, compute_ms: float) -> dict:
    return {
        "step": step,
        "rank": rank,
        "host": f"node{rank}",
        "data_s": 0.001,
        "compute_s": compute_ms / 1e3,
        "comm_wait_s": 0.0,
        "step_s": 0.06,
        "samples_per_s": 500.0,
    }


def test_ranks_png_has_a_line_per_rank_with_the_slow_rank_on_top(tmp_path, capsys):
    from matplotlib import pyplot as plt

    from ddpkit.cli.plot import draw_ranks

    records = [
        _rank(step, rank, 50.0 if rank == 1 else 30.0) for step in (20, 40) for rank in (0, 1, 2)
    ]
    (tmp_path / "metrics.jsonl").write_text(json.dumps(EPOCH) + "\n")
    (tmp_path / "ranks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    code, err = run_main(["plot", str(tmp_path)], capsys)
    assert code == 0, err
    assert (tmp_path / "ranks.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig, (own, data) = plt.subplots(2, 1)
    draw_ranks(own, data, records=records)
    labels = [line.get_label() for line in own.lines]
    assert labels[:3] == ["rank 0 (node0)", "rank 1 (node1)", "rank 2 (node2)"]
    assert list(own.lines[1].get_ydata()) == pytest.approx([51.0, 51.0])  # data + compute, ms
    assert list(own.lines[1].get_xdata()) == [20, 40] and len(data.lines) == 3
    plt.close(fig)


def test_no_ranks_png_without_rank_records(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(EPOCH) + "\n")
    code, err = run_main(["plot", str(tmp_path)], capsys)
    assert code == 0, err
    assert not (tmp_path / "ranks.png").exists() and (tmp_path / "loss.png").exists()
