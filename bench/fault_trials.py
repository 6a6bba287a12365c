"""Fault trials: a rank SIGKILLed at a random step, and a checkpoint writer killed mid-save.

    python bench/fault_trials.py --trials 20

1. ``ddpkit run -n 2``: a random rank kills itself with SIGKILL at a random step while the other
   waits in an all-reduce (train timeout 1800 s). Measures the time from the kill to the end of
   the job, checks the summary names the killed rank, and that no worker outlives the job.
2. A process saving checkpoints in a loop is SIGKILLed at a random moment; the newest complete
   checkpoint must load.

Prints one line per trial and closing 'N passed, N failed' lines.
"""

from __future__ import annotations

import argparse
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def rank_kill_trial(rng: random.Random, workdir: Path) -> tuple[bool, str]:
    victim, kill_step = rng.randrange(2), rng.randrange(5, 60)
    stamp = workdir / "killed-at"
    stamp.unlink(missing_ok=True)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddpkit",
            "run",
            "-n",
            "2",
            str(HERE / "_kill_worker.py"),
            str(victim),
            str(kill_step),
            str(stamp),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    end = time.time()
    elapsed = end - float(stamp.read_text())
    expected = f"first failure: rank {victim}/2 died from signal SIGKILL"
    ok = proc.returncode == 1 and expected in proc.stderr and elapsed < 15
    return (
        ok,
        f"rank {victim} killed at step {kill_step}: job ended {elapsed:.2f} s later, "
        f"exit {proc.returncode}, named={'yes' if expected in proc.stderr else 'NO'}",
    )


def writer_kill_trial(rng: random.Random, directory: Path) -> tuple[bool, str]:

    import ddpkit
    from ddpkit.env import ProcessInfo
    from ddpkit.runtime.process_group import Runtime

    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpkit.testing.checkpoint_writer", str(directory), "--mnist"],
        stdout=subprocess.PIPE,
        text=True,
    )
    proc.stdout.readline()
    time.sleep(rng.uniform(0.02, 1.0))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    found = ddpkit.CheckpointManager(directory, Runtime(ProcessInfo())).load_latest()
    return found is not None, f"newest loadable: {found[0].name if found else None}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, trial in (("rank kill", rank_kill_trial), ("writer kill", writer_kill_trial)):
            bad = 0
            for i in range(1, args.trials + 1):
                ok, line = trial(rng, Path(tmp))
                bad += not ok
                print(f"{name} {i}: {'ok' if ok else 'FAILED'}: {line}", flush=True)
            print(f"{name}: {args.trials - bad} passed, {bad} failed", flush=True)
            failed += bad
    print(f"{2 * args.trials - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
