"""What ``ddpkit train`` writes to its output folder, and the clean-up of an earlier run's files.

``metrics.jsonl``/``metrics.csv`` hold one record per epoch (key ``epoch``), ``steps.jsonl``/
``steps.csv`` one per ``log_every`` optimizer steps (key ``step``), ``ranks.jsonl``/``ranks.csv``
one per rank per straggler window (keys ``step`` and ``rank``): the same records in both
formats, the CSV header taken from the first record. ``summary.json`` is written atomically,
``tensorboard/`` holds the event files. Rank 0 writes; the others wait where noted."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import shutil
from pathlib import Path

from ddpkit.checkpoint.lock import LOCK_NAME
from ddpkit.checkpoint.manager import SET_ASIDE
from ddpkit.errors import ConfigError
from ddpkit.files import write_text_atomic
from ddpkit.runtime.collectives import barrier
from ddpkit.runtime.process_group import Runtime


def finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None  # JSON has no NaN/Inf


def checkpoint_folder(output_dir: str | os.PathLike[str]) -> Path:
    """Where ``ddpkit train`` keeps the checkpoints of the run in ``output_dir``."""
    return Path(output_dir) / "checkpoints"


def earlier_run(output_dir: str | Path) -> list[str]:
    """What an earlier run left in ``output_dir`` that a fresh run would delete or overwrite:
    its checkpoints (``checkpoints/step-*``, newest first), then the output files, by name."""
    out = Path(output_dir)
    steps = sorted(checkpoint_folder(out).glob("step-*"), reverse=True)
    found = [f"{checkpoint_folder(out).name}/{p.name}" for p in steps]
    records = [f"{stem}.{suffix}" for stem in RECORD_FILES for suffix in ("jsonl", "csv")]
    for name in ("summary.json", "model.pt", *records, "tensorboard", "attempts"):
        if (out / name).exists():
            found.append(name)
    return found


def check_fresh_output(output_dir: str | Path, *, resume_auto: bool = False) -> None:
    """Refuse a fresh run in a folder that holds an earlier one (before anything starts).

    ``resume_auto``: the run asked for ``--resume auto``; refused only where there is nothing to
    resume and the earlier run finished (its ``summary.json``), which the run would replace. A
    run stopped before its first checkpoint (a requeued job) starts again.

    Raises:
        ConfigError: ``output_dir`` holds checkpoints or outputs of an earlier run (named).
    """
    found = earlier_run(output_dir)
    has_checkpoints = bool(found) and found[0].startswith(f"{checkpoint_folder(output_dir).name}/")
    if resume_auto and (has_checkpoints or "summary.json" not in found):
        return
    if found:
        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        resume = "continue it with --resume auto, or " if has_checkpoints else ""
        what = f"an earlier run ({shown}), which a fresh run would delete"
        if resume_auto:
            what = (
                f"a finished run without checkpoints ({shown}): --resume auto has nothing to "
                "continue, and a fresh run would delete it"
            )
        raise ConfigError(
            f"--output-dir {output_dir} holds {what}: {resume}start afresh in another "
            "--output-dir, or pass --overwrite to delete it."
        )


# file stem -> the record's counter key; ranks: each rank's straggler window figures
RECORD_FILES = {"metrics": "epoch", "steps": "step", "ranks": "step"}


def reset_outputs(
    output_dir: Path, runtime: Runtime, completed_epochs: int | None, completed_step: int = 0
) -> None:
    """Rank 0 clears what an earlier run left; a resumed run keeps its checkpoints, the epoch
    records of the ``completed_epochs`` and the step records up to ``completed_step`` (JSONL
    and CSV). ``completed_epochs=None``: a new run, every record and event file removed.

    Collective: call on every rank (a barrier).
    """
    if runtime.is_rank_zero:
        for name in ("summary.json", "model.pt"):
            (output_dir / name).unlink(missing_ok=True)
        if completed_epochs is None:  # this job's lock stays, and what a resume set aside
            for old in checkpoint_folder(output_dir).glob("*"):
                if old.name not in (LOCK_NAME, SET_ASIDE):
                    shutil.rmtree(old, ignore_errors=True)
            shutil.rmtree(output_dir / "tensorboard", ignore_errors=True)
        limits = {"epoch": completed_epochs, "step": completed_step}
        for stem, key in RECORD_FILES.items():
            records = [] if completed_epochs is None else read_records(output_dir / f"{stem}.jsonl")
            _rewrite(output_dir, stem, [r for r in records if r[key] <= limits[key]])
    barrier(runtime)


def read_records(path: Path) -> list[dict]:
    """The records of a JSONL file (blank lines skipped; none when the file is missing).

    Raises:
        ValueError: a line is not a JSON object (``json.JSONDecodeError`` is one).
    """
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not all(isinstance(r, dict) for r in records):
        raise ValueError(f"{path}: every line must be a JSON object")
    return records


def _rewrite(output_dir: Path, stem: str, records: list[dict]) -> None:
    for suffix in ("jsonl", "csv"):
        (output_dir / f"{stem}.{suffix}").unlink(missing_ok=True)
    for record in records:
        append_record(output_dir, stem, record)


def append_record(output_dir: Path, stem: str, record: dict) -> None:
    """Append ``record`` to ``<stem>.jsonl`` and ``<stem>.csv`` (non-finite floats: null/empty).

    The CSV's columns are the first record's keys; later records fill those columns (empty
    where a record lacks one). A record with a new key rewrites the CSV from the JSONL with
    every key seen, so no value is dropped.
    """
    clean = {k: finite_or_none(v) if isinstance(v, float) else v for k, v in record.items()}
    with (output_dir / f"{stem}.jsonl").open("a") as handle:
        handle.write(json.dumps(clean) + "\n")
    path = output_dir / f"{stem}.csv"
    new = not path.exists() or path.stat().st_size == 0
    if new:
        columns = list(clean)
    else:
        with path.open(newline="") as handle:
            columns = next(csv.reader(handle))
        if set(clean) - set(columns):  # e.g. resumed with --step-timing on after off
            _rewrite_csv(output_dir, stem)
            return
    with path.open("a", newline="") as handle:
        writer = csv.DictWriter(handle, columns, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerow(clean)


def _rewrite_csv(output_dir: Path, stem: str) -> None:
    records = read_records(output_dir / f"{stem}.jsonl")
    columns = list(dict.fromkeys(key for record in records for key in record))
    buffer = io.StringIO(newline="")
    writer = csv.DictWriter(buffer, columns)
    writer.writeheader()
    writer.writerows(records)
    write_text_atomic(output_dir / f"{stem}.csv", buffer.getvalue())
