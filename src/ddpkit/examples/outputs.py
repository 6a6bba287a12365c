"""What ``ddpkit train`` writes to its output folder: metrics.jsonl, summary.json (atomically),
and the clean-up of an earlier run's files. Rank 0 writes; the others wait where noted."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

from ddpkit.distributed.collectives import barrier
from ddpkit.distributed.process_group import Runtime


def finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None  # JSON has no NaN/Inf


def write_json_atomic(path: Path, payload: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n")
    os.replace(tmp, path)


def reset_outputs(output_dir: Path, runtime: Runtime, completed_epochs: int | None) -> None:
    """Rank 0 clears what an earlier run left; a resumed run keeps its checkpoints and the
    metrics of the epochs it completed. Collective (a barrier)."""
    if runtime.is_rank_zero:
        for name in ("summary.json", "model.pt"):
            (output_dir / name).unlink(missing_ok=True)
        metrics = output_dir / "metrics.jsonl"
        if completed_epochs is None:
            shutil.rmtree(output_dir / "checkpoints", ignore_errors=True)
            metrics.unlink(missing_ok=True)
        elif metrics.exists():
            kept = [
                r
                for r in metrics.read_text().splitlines()
                if r.strip() and json.loads(r)["epoch"] <= completed_epochs
            ]
            metrics.write_text("".join(f"{r}\n" for r in kept))
    barrier(runtime)


def append_metrics(output_dir: Path, record: dict) -> None:
    with (output_dir / "metrics.jsonl").open("a") as handle:
        handle.write(json.dumps({k: finite_or_none(v) for k, v in record.items()}) + "\n")
