"""Run a 2-process job many times in a row and count clean exits (exit status 0, no hang).

    python bench/exit_soak.py --runs 50                          # ddpkit run, the example
    python bench/exit_soak.py --runs 50 --launcher torchrun      # plain torchrun, same script

Each run gets a hard timeout; a run that exceeds it counts as a hang and its process group is
killed. Prints one line per failure and a closing 'N passed, N failed' line.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_custom.py"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--launcher", choices=("ddpkit", "torchrun"), default="ddpkit")
    parser.add_argument("--timeout-s", type=float, default=120)
    parser.add_argument("script", nargs="?", default=str(EXAMPLE))
    args = parser.parse_args()
    launch = (
        [sys.executable, "-m", "ddpkit", "run", "-n", "2"]
        if args.launcher == "ddpkit"
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
        ]
    )
    command = [*launch, args.script, "--epochs", "1"]
    failed, durations = 0, []
    for run in range(1, args.runs + 1):
        start = time.monotonic()
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        try:
            output, _ = proc.communicate(timeout=args.timeout_s)
            status = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            status = "hang"
        durations.append(time.monotonic() - start)
        if status != 0:
            failed += 1
            tail = " | ".join(output.strip().splitlines()[-3:])
            print(f"run {run}: exit {status}: {tail}", flush=True)
    durations.sort()
    print(
        f"{args.launcher}: {args.runs} runs of {Path(args.script).name}, median "
        f"{durations[len(durations) // 2]:.1f} s per run"
    )
    print(f"{args.runs - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
