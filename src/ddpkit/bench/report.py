"""What every ``ddpkit bench`` report shares: medians, the machine it ran on, a table on screen,
and CSV/JSON files (written atomically)."""

from __future__ import annotations

import csv
import io
import os
import platform
import statistics
from collections.abc import Sequence
from pathlib import Path

from ddpkit.errors import ConfigError
from ddpkit.files import json_text, unwritable_ancestor, write_text_atomic
from ddpkit.launch.resources import available_memory_bytes  # noqa: F401 (re-exported)


def median(values: Sequence[float]) -> float:
    """The median of ``values`` (the statistic every ddpkit benchmark reports).

    Raises:
        ValueError: ``values`` is empty.
    """
    if not values:
        raise ValueError("median of no measurements")
    return float(statistics.median(values))


def machine() -> dict:
    """The machine a figure was measured on: cores, Python, torch version, CUDA devices."""
    import torch

    return {
        "cpu_cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "platform": platform.platform(),
    }


def machine_line(info: dict | None = None) -> str:
    """One line naming the machine, printed above every table."""
    info = info or machine()
    gpus = f", {info['cuda_devices']} CUDA device(s)" if info["cuda_devices"] else ", no GPU"
    return (
        f"machine: {info['cpu_cores']} CPU cores{gpus}, Python {info['python']}, "
        f"torch {info['torch']}"
    )


def format_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """Rows as an aligned text table.

    Args:
        rows: one dict per row.
        columns: ``(key, header, format spec)``, e.g. ``("busbw_gbps", "busbw GB/s", ".3f")``;
            a missing or ``None`` value prints as ``-``.
    """
    cells = [[header for _, header, _ in columns]]
    for row in rows:
        cells.append(
            ["-" if row.get(key) is None else format(row[key], spec) for key, _, spec in columns]
        )
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = (zip(line, widths, strict=True) for line in cells)
    return "\n".join("  ".join(cell.rjust(width) for cell, width in line) for line in lines)


def output_problem(flag: str, path: str | Path | None) -> str | None:
    """Why ``path`` (the value of ``flag``) cannot take a report, or ``None`` when it can.

    Checked before a benchmark runs, so a bad path costs no measurement: the path must not be
    a folder, and its nearest existing parent must be a writable folder (missing folders are
    created when the report is written).
    """
    if path is None:
        return None
    path = Path(path)
    if path.is_dir():
        return f"{flag} {path} is a folder; name a file in it"
    blocked = unwritable_ancestor(path.parent)
    if blocked is None:
        return None
    parent, why = blocked
    if why == "not a folder":
        return f"{flag} {path}: {parent} is not a folder"
    return f"{flag} {path}: folder {parent} is not writable"


def _write_atomic(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, text)
    except OSError as exc:
        raise ConfigError(
            f"cannot write the report: path={path} ({exc.strerror}). Pass a path in a "
            "writable folder."
        ) from exc


def write_csv(path: Path, rows: Sequence[dict]) -> None:
    """``rows`` as CSV with a header of the first row's keys (written atomically).

    Raises:
        ConfigError: the file cannot be written (nothing is left behind).
    """
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]) if rows else [])
    writer.writeheader()
    writer.writerows(rows)
    _write_atomic(Path(path), buffer.getvalue())


def write_json(path: Path, payload: dict | list) -> None:
    """``payload`` as indented JSON (written atomically; NaN/Inf refused).

    Raises:
        ConfigError: the file cannot be written (nothing is left behind).
    """
    _write_atomic(Path(path), json_text(payload))
