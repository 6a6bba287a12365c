"""Per-step cost of ddpkit train's guards: samples/s with and without, interleaved, medians.

    python bench/guard_cost.py --pairs 3 --data-dir ../shared/data/mnist

Runs ``ddpkit train --nproc 2 --max-steps S`` alternately with the guard settings below and
reports the median samples/s of each and its ratio to the unguarded run (``--stall-timeout 0``,
``--on-nonfinite off``). The watchdog is on by default in ``ddpkit train`` (300 s); the other
guards are off by default.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

OFF = ["--stall-timeout", "0", "--on-nonfinite", "off"]
DEBUG = {"DDPKIT_DEBUG_COLLECTIVES": "1"}
# name -> (flags, extra environment); later flags win over OFF's
FORMS: dict[str, tuple[list[str], dict[str, str]]] = {
    "no guards": (OFF, {}),
    "watchdog (--stall-timeout 300)": ([*OFF, "--stall-timeout", "300"], {}),
    "non-finite guard (--on-nonfinite raise)": ([*OFF, "--on-nonfinite", "raise"], {}),
    "replica check every 10 steps": ([*OFF, "--check-replicas-every", "10"], {}),
    "collective shape checks (DDPKIT_DEBUG_COLLECTIVES=1)": (OFF, DEBUG),
    "all of the above": (
        ["--on-nonfinite", "raise", "--check-replicas-every", "10", "--stall-timeout", "300"],
        DEBUG,
    ),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--data-dir", required=True)
    args = parser.parse_args()
    rates: dict[str, list[float]] = {name: [] for name in FORMS}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.pairs):
            for name, (flags, env) in FORMS.items():  # interleaved: A B C A B C ...
                out = Path(tmp) / "run"
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "ddpkit",
                        "train",
                        "--nproc",
                        "2",
                        "--data-dir",
                        args.data_dir,
                        "--max-steps",
                        str(args.max_steps),
                        "--output-dir",
                        str(out),
                        *flags,
                    ],
                    check=True,
                    capture_output=True,
                    env={**os.environ, **env},
                )
                rates[name].append(json.loads((out / "summary.json").read_text())["samples_per_s"])
    base = statistics.median(rates["no guards"])
    for name, values in rates.items():
        median = statistics.median(values)
        print(
            f"{name:55s} {median:8.0f} samples/s  ratio {median / base:.3f}  (runs: "
            + ", ".join(f"{v:.0f}" for v in values)
            + ")"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
