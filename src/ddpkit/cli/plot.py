"""``ddpkit plot OUTPUT_DIR``: PNG plots of a ``ddpkit train`` output folder (matplotlib, Agg).

Run it::

    ddpkit train --nproc 2 --epochs 3 --output-dir runs/mnist
    ddpkit plot runs/mnist                   # writes loss.png, accuracy.png, throughput.png,
                                             # step_time.png (and ranks.png) into runs/mnist

Reads ``metrics.jsonl`` (one record per epoch, required), ``steps.jsonl`` (one record per
``--log-every`` steps, optional) and ``ranks.jsonl`` (each rank's figures per straggler window,
optional: ``ranks.png`` is drawn when it has records).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ddpkit.app.mnist.outputs import read_records
from ddpkit.errors import ConfigError
from ddpkit.monitoring.observe import PHASES

PLOTS = ("loss.png", "accuracy.png", "throughput.png", "step_time.png")
RANKS_PLOT = "ranks.png"
EPOCH_KEYS = ("epoch", "train_loss", "test_loss", "test_accuracy", "samples_per_s")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plot",
        help="PNG plots of a ddpkit train output folder",
        description="Write loss.png (train loss per logged step and per epoch, test loss), "
        "accuracy.png (test accuracy per epoch), throughput.png (global samples/s per epoch "
        "and per logged step), step_time.png (seconds per step, stacked by phase, per "
        "epoch) from OUTPUT_DIR/metrics.jsonl and steps.jsonl, and ranks.png (each rank's own "
        "work and data loading per step over the steps: a straggler stands above the others) "
        "from ranks.jsonl when a multi-process run wrote it.",
    )
    parser.add_argument("output_dir", metavar="OUTPUT_DIR", help="a ddpkit train --output-dir")
    parser.add_argument(
        "--out", default=None, metavar="DIR", help="where the PNGs go (default OUTPUT_DIR)"
    )
    parser.set_defaults(handler=run)


def load_run(output_dir: Path) -> tuple[list[dict], list[dict]]:
    """The epoch records (metrics.jsonl) and step records (steps.jsonl) of a run.

    Raises:
        ConfigError: the folder or metrics.jsonl is missing, a file is empty or malformed, or
            an epoch record lacks one of the keys the plots need.
    """
    if not output_dir.is_dir():
        raise ConfigError(
            f"no such output folder: output_dir={output_dir}. Pass the --output-dir of a "
            "ddpkit train run."
        )
    records: dict[str, list[dict]] = {}
    for name in ("metrics.jsonl", "steps.jsonl"):
        path = output_dir / name
        try:
            records[name] = read_records(path)
        except (ValueError, OSError) as exc:
            raise ConfigError(
                f"cannot read {path}: {str(exc).splitlines()[0]}. It must hold one JSON object "
                "per line, as ddpkit train writes; rerun the training to regenerate it."
            ) from exc
    epochs, steps = records["metrics.jsonl"], records["steps.jsonl"]
    if not epochs:
        so_far = (
            f"; steps.jsonl holds {len(steps)} step record(s), up to step {steps[-1].get('step')}"
            if steps
            else ""
        )
        raise ConfigError(
            f"no epoch records in {output_dir / 'metrics.jsonl'} (missing or empty){so_far}. "
            "The plots need one completed epoch: plot again after epoch 1 ends (steps.csv "
            "holds the step records meanwhile)."
        )
    missing = sorted({k for r in epochs for k in EPOCH_KEYS if k not in r})
    if missing:
        raise ConfigError(
            f"{output_dir / 'metrics.jsonl'}: records lack {', '.join(missing)}. Plot the "
            "output of ddpkit train."
        )
    return epochs, steps


def _values(records: list[dict], key: str) -> list[float]:
    return [float("nan") if r.get(key) is None else float(r[key]) for r in records]


def write_plots(epochs: list[dict], steps: list[dict], out_dir: Path) -> list[Path]:
    """Write the four PNGs into ``out_dir`` (created); returns their paths.

    Raises:
        ConfigError: a PNG cannot be written (read-only folder, a folder in its place).

    Epoch-level curves use the epoch number as x; step-level ones the optimizer step, drawn on
    a second x axis scaled to epochs (``step / steps_per_epoch``) where epochs record ``step``.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in PLOTS:
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
        draw_plot(ax, name, epochs, steps)
        fig.tight_layout()
        path = out_dir / name
        try:
            fig.savefig(path, format="png")
        except OSError as exc:
            raise ConfigError(
                f"cannot write the plot: path={path} ({exc.strerror}). Pass --out a writable "
                "folder."
            ) from exc
        finally:
            plt.close(fig)
        paths.append(path)
    return paths


def draw_plot(ax, name: str, epochs: list[dict], steps: list[dict]) -> None:
    """Draw plot ``name`` (one of :data:`PLOTS`) onto the matplotlib axes ``ax``.

    x is in epochs from 0; step records (``steps.jsonl``) give the curves within an epoch, so a
    1-epoch run shows its loss and throughput over its steps, not one dot. A value that has a
    single point (an epoch-level figure of a 1-epoch run) is written next to its marker.
    """
    x = _values(epochs, "epoch")
    steps_per_epoch = _steps_per_epoch(epochs)
    step_x = [s["step"] / steps_per_epoch for s in steps] if steps_per_epoch else []
    if name == "loss.png":
        if step_x:
            ax.plot(step_x, _values(steps, "loss"), alpha=0.5, label="train loss (logged steps)")
        _epoch_series(ax, x, _values(epochs, "train_loss"), "o-", "train loss (epoch mean)")
        _epoch_series(ax, x, _values(epochs, "test_loss"), "s-", "test loss")
        ax.set_ylabel("cross-entropy loss")
    elif name == "accuracy.png":
        _epoch_series(ax, x, _values(epochs, "test_accuracy"), "o-", "test accuracy")
        ax.set_ylabel("accuracy (0..1)")
    elif name == "throughput.png":
        if step_x:
            ax.plot(step_x, _values(steps, "samples_per_s"), alpha=0.5, label="logged steps")
        _epoch_series(ax, x, _values(epochs, "samples_per_s"), "o-", "epoch", ".0f")
        ax.set_ylabel("global samples/s")
    else:
        _stacked_phases(ax, epochs, x)
    if name != "step_time.png":
        ax.set_xlim(0, max(x) * 1.05 if x else 1)  # from the start of training
    if len(epochs) == 1 and not step_x:
        ax.set_title("one epoch and no step records: --log-every N below its steps draws curves")
    ax.set_xlabel("epoch")
    ax.grid(alpha=0.3)
    ax.legend()


def _epoch_series(ax, x: list[float], y: list[float], style: str, label: str, fmt=".4f") -> None:
    """One value per epoch; a lone point gets its value written beside it."""
    ax.plot(x, y, style, label=label)
    if len(x) == 1 and y[0] == y[0]:
        ax.annotate(
            format(y[0], fmt), (x[0], y[0]), xytext=(-8, 6), textcoords="offset points", ha="right"
        )


def _steps_per_epoch(epochs: list[dict]) -> float:
    first = epochs[0]
    if first.get("step") is None or not first.get("epoch"):
        return 0.0
    return first["step"] / first["epoch"]  # a resumed first record still ends at step E*S


def _stacked_phases(ax, epochs: list[dict], x: list[float]) -> None:
    bottom = [0.0] * len(epochs)
    for phase in PHASES:
        values = [v if v == v else 0.0 for v in _values(epochs, f"{phase}_s_per_step")]
        ax.bar(x, values, bottom=bottom, label=phase, width=0.6)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xticks(x)
    ax.set_ylabel("seconds per optimizer step (mean over ranks)")


def run(args: argparse.Namespace) -> int:
    output_dir = Path(args.output_dir)
    epochs, steps = load_run(output_dir)
    out_dir = Path(args.out) if args.out else output_dir
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot create the plot folder: --out {out_dir} ({exc.strerror}). Pass a "
            "writable folder."
        ) from exc
    paths = write_plots(epochs, steps, out_dir)
    ranks = _read_optional(output_dir / "ranks.jsonl")
    if ranks:
        paths.append(write_ranks_plot(ranks, out_dir / RANKS_PLOT))
    for path in paths:
        print(path)
    return 0


def _read_optional(path: Path) -> list[dict]:
    try:
        return read_records(path)
    except (ValueError, OSError) as exc:
        raise ConfigError(
            f"cannot read {path}: {str(exc).splitlines()[0]}. It must hold one JSON object "
            "per line, as ddpkit train writes; rerun the training to regenerate it."
        ) from exc


def write_ranks_plot(records: list[dict], path: Path) -> Path:
    """``ranks.png``: per rank, its own work (data + compute) and its data loading, median
    milliseconds per step of each straggler window, over the optimizer steps.

    Raises:
        ConfigError: the PNG cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, (own, data) = plt.subplots(2, 1, figsize=(7, 6), dpi=100, sharex=True)
    draw_ranks(own, data, records=records)
    fig.tight_layout()
    try:
        fig.savefig(path, format="png")
    except OSError as exc:
        raise ConfigError(
            f"cannot write the plot: path={path} ({exc.strerror}). Pass --out a writable folder."
        ) from exc
    finally:
        plt.close(fig)
    return path


def draw_ranks(own, data, *, records: list[dict]) -> None:
    """One line per rank on each axes: ``own`` gets data + compute, ``data`` data loading."""
    by_rank: dict[int, list[dict]] = {}
    for record in records:
        by_rank.setdefault(int(record["rank"]), []).append(record)
    for rank, rows in sorted(by_rank.items()):
        steps = [row["step"] for row in rows]
        label = f"rank {rank} ({rows[0].get('host', '?')})"
        work = [(row["data_s"] + row["compute_s"]) * 1e3 for row in rows]
        own.plot(steps, work, marker=".", label=label)
        data.plot(steps, [row["data_s"] * 1e3 for row in rows], marker=".", label=label)
    step_ms = [row["step_s"] * 1e3 for row in by_rank[min(by_rank)]]
    own.plot(
        [row["step"] for row in by_rank[min(by_rank)]],
        step_ms,
        "k--",
        alpha=0.5,
        label="step (every rank waits for the slowest)",
    )
    own.set_title("own work per step by rank: a straggler stands above the others")
    own.set_ylabel("data + compute, ms per step")
    data.set_ylabel("data loading, ms per step")
    data.set_xlabel("optimizer step (median over each straggler window)")
    for ax in (own, data):
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
