"""What ddpkit's default guards cost: ``ddpkit train`` at this checkout vs an earlier revision.

    python bench/default_cost.py --baseline 0dc5137 --pairs 3 --data-dir ../shared/data/mnist

Exports the baseline revision's ``src/`` with ``git archive`` into a temporary folder, then runs
``ddpkit train --nproc 2 --epochs 1`` alternately with that code and this checkout's (A B A B,
same flags, same data, each run on PYTHONPATH), and reports each side's median samples/s (the
job's own ``summary.json``) and the ratio new/old. Both sides run their defaults: the difference
is what the guards that are on by default (watchdog, wrap checks, loader checks, save-time
comparisons, evaluate's buffer broadcast) cost in the MNIST job.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def export_src(revision: str, into: Path) -> Path:
    """``git archive REVISION src`` unpacked under ``into``; returns the ``src`` folder."""
    archive = into / "src.tar"
    with archive.open("wb") as handle:
        subprocess.run(
            ["git", "-C", str(REPO), "archive", revision, "src"], stdout=handle, check=True
        )
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def run_train(src: Path, data_dir: str, out: Path, extra: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    argv = [
        sys.executable,
        "-m",
        "ddpkit",
        "train",
        "--nproc",
        "2",
        "--epochs",
        "1",
        "--data-dir",
        data_dir,
        "--output-dir",
        str(out),
        *extra,
    ]
    subprocess.run(argv, env=env, check=True, capture_output=True, timeout=900)
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="git revision to compare against")
    parser.add_argument("--pairs", type=int, default=3, help="A/B pairs (default 3)")
    parser.add_argument("--data-dir", required=True, help="folder with the four MNIST files")
    parser.add_argument("extra", nargs="*", help="more ddpkit train flags (after --)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ddpkit-cost-") as tmp:
        sides = {"old": export_src(args.baseline, Path(tmp)), "new": REPO / "src"}
        rates: dict[str, list[float]] = {"old": [], "new": []}
        for pair in range(args.pairs):
            order = ("old", "new") if pair % 2 == 0 else ("new", "old")
            for side in order:
                summary = run_train(
                    sides[side], args.data_dir, Path(tmp) / f"{side}{pair}", args.extra
                )
                rates[side].append(summary["samples_per_s"])
                print(
                    f"pair {pair} {side}: {summary['samples_per_s']:.0f} samples/s, "
                    f"accuracy {summary['test_accuracy']:.4f}",
                    flush=True,
                )
    old, new = (statistics.median(rates[s]) for s in ("old", "new"))
    print(
        f"median samples/s: {args.baseline} {old:.0f}, this checkout {new:.0f}, "
        f"ratio new/old {new / old:.3f} ({os.cpu_count()} cores)"
    )


if __name__ == "__main__":
    main()
