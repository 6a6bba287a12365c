"""Live fault tolerance under faults, against restart-everything, on the same faults.

    OMP_NUM_THREADS=1 .venv/bin/python bench/live_trials.py trials --count 50
    OMP_NUM_THREADS=1 .venv/bin/python bench/live_trials.py goodput --every 60 15 --minutes 3
    OMP_NUM_THREADS=1 .venv/bin/python bench/live_trials.py cost --rounds 5
    OMP_NUM_THREADS=1 .venv/bin/python bench/live_trials.py cost --rounds 3 --data-dir DIR

``trials``: each trial is one ``ddpkit run -n 3 --fault-tolerance live`` job of
``tests/live/scripts/live_loop.py`` (``LOG_STEPS=1``: every worker logs each committed step's
parameter checksum and samples), with one fault chosen by a seeded RNG: SIGKILL, SIGSTOP (found
by the heartbeat, ``--heartbeat-timeout 3``) or SIGTERM (a preemption notice to that worker
alone) to a random worker at a random moment (mostly inside backward: its 30 ms sleep is about
two thirds of a step), two SIGKILLs 0-1 s apart, or a SIGKILL of the replacement while it heals;
warm spares on every other trial. Checked per trial: exit 0; the survivors are the processes
that started (0 survivor restarts); steps discarded per failure; replicas equal after every
committed step (same checksum for the same step on every worker that logged it: 0 forks); the
final models equal; every sample of every epoch trained exactly once, counting the padding a
re-shard adds (``DistributedSampler``'s rule: the rows are completed with the epoch's first
indices); detection (fault to the launcher's line), stall (the members' line: the failed step
and the move to the next quorum), heal time and rejoin (fault to the replacement healed), from
timestamps of the output lines as they arrive. ``--restart`` trials run the same SIGKILLs under
``ddpkit run --max-restarts 3`` (torchrun restarts every worker, which resume from the newest
checkpoint): time from the fault to training past the step it had reached, steps trained again.

``goodput``: ``ddpkit train --dataset digits`` on ``--nproc`` ranks (2: one per core here; 3
on 2 cores runs slower than 2, so losing a rank looks like a gain) for ``--minutes`` of epochs,
a SIGKILL to a random worker every ``--every`` seconds, live (``--max-restarts 100 --spares
1``) against restart
(``--max-restarts 100 --checkpoint-every 10``): goodput = (the job's samples per second of wall
time with faults) / (the same without faults), each mode against its own fault-free run.

``cost``: the same digits job (or one epoch of MNIST with ``--data-dir``) without faults, live
against restart, interleaved, medians of samples/s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "live" / "scripts" / "live_loop.py"
DATASET_LEN = 2560  # live_loop.py's training samples
KINDS = ("kill", "kill", "stop", "term", "two_kills", "kill_healing")


class Job:
    """A launched job whose output lines are read as they come, each with its arrival time."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **env},
            start_new_session=True,
        )
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def first(self, pattern: str, after: float = 0.0) -> tuple[float, str] | None:
        regex = re.compile(pattern)
        return next(((t, s) for t, s in self.lines if t >= after and regex.search(s)), None)

    def wait(self, timeout_s: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            code = -999  # a hang
        self._reader.join(timeout=10)
        return code

    @property
    def output(self) -> str:
        return "\n".join(s for _, s in self.lines)


def _slots(out: Path) -> dict[int, int]:
    """slot -> pid of the newest live worker in it (restart mode's workers have no slot: by
    start order)."""
    newest: dict[int, tuple[float, int]] = {}
    paths = sorted(out.glob("pid-*"), key=lambda p: p.stat().st_mtime)
    for order, path in enumerate(paths):
        pid = int(path.name[4:])
        if Path(f"/proc/{pid}").exists():
            slot = int(path.read_text())
            slot = slot if slot >= 0 else order % 3
            if slot not in newest or path.stat().st_mtime > newest[slot][0]:
                newest[slot] = (path.stat().st_mtime, pid)
    return {slot: pid for slot, (_, pid) in newest.items()}


def _step(out: Path) -> int:
    try:
        return int((out / "progress").read_text())
    except (OSError, ValueError):
        return 0


def _wait_step(out: Path, job: Job, step: int, timeout_s: float = 120) -> bool:
    deadline = time.monotonic() + timeout_s
    while _step(out) < step:
        if job.proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _inject(kind: str, out: Path, job: Job, rng: random.Random) -> tuple[float, set[int]]:
    """The fault; returns its time and the pids of the workers that should survive it."""
    slots = _slots(out)
    victim_slot = rng.randrange(3)
    victim = slots[victim_slot]
    time.sleep(rng.uniform(0.0, 0.05))  # a random moment inside a step
    at = time.monotonic()
    if kind in ("kill", "kill_healing"):
        os.kill(victim, signal.SIGKILL)
    elif kind == "stop":
        os.kill(victim, signal.SIGSTOP)
    elif kind == "term":
        os.kill(victim, signal.SIGTERM)
    elif kind == "two_kills":
        os.kill(victim, signal.SIGKILL)
        time.sleep(rng.uniform(0.0, 1.0))
        other = (victim_slot + rng.randrange(1, 3)) % 3
        os.kill(slots[other], signal.SIGKILL)
        slots.pop(other)
    slots.pop(victim_slot)
    if kind == "kill_healing":  # then the replacement, while the survivors send it the state
        deadline = time.monotonic() + 90
        while not (out / "healing").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        replacement = _slots(out).get(victim_slot)
        if replacement is not None and replacement != victim:
            os.kill(replacement, signal.SIGKILL)
    return at, set(slots.values())


def _check_logs(out: Path) -> dict:
    """Forks (a step whose checksum differs across workers) and the sample accounting: the
    samples of every forward (``F step quorum``) whose step was committed in that quorum
    (``C step quorum``, by any worker), counted per epoch."""
    by_step: dict[str, set[str]] = {}
    epoch_of: dict[str, int] = {}
    forwards: dict[str, list[int]] = {}
    for path in out.glob("steps-*.txt"):
        for line in path.read_text().splitlines():
            kind, step, quorum, rest = line.split(" ", 3)
            if kind == "C":
                digest, epoch = rest.split()
                by_step.setdefault(f"{step} {quorum}", set()).add(digest)
                epoch_of[f"{step} {quorum}"] = int(epoch)
            else:
                forwards.setdefault(f"{step} {quorum}", []).extend(json.loads(rest))
    samples: dict[int, Counter] = {}
    for step_key, epoch in epoch_of.items():
        samples.setdefault(epoch, Counter()).update(forwards.get(step_key, []))
    steps: dict[str, set[str]] = {}
    for step_key, digests in by_step.items():
        steps.setdefault(step_key.split()[0], set()).update(digests)
    forks = sum(1 for digests in steps.values() if len(digests) > 1)
    missing = repeats = 0
    for counts in samples.values():
        missing += sum(1 for i in range(DATASET_LEN) if counts[i] == 0)
        repeats += sum(c - 1 for c in counts.values() if c > 1)
    return {
        "forks": forks,
        "steps_logged": len(steps),
        "epochs": len(samples),
        "missing_samples": missing,
        "padding_repeats": repeats,
    }


def live_trial(index: int, kind: str, spares: int, rng: random.Random, root: Path) -> dict:
    out = root / f"trial-{index:03d}"
    out.mkdir(parents=True)
    env = {"STEP_S": "0.03", "EPOCHS": "8", "LOG_STEPS": "1", "CKPT_EVERY": "0"}
    if kind == "kill_healing":
        env["SLOW_HEAL_S"] = "1"
    command = [
        sys.executable,
        "-m",
        "ddpkit",
        "run",
        "-n",
        "3",
        "--fault-tolerance",
        "live",
        "--heartbeat-timeout",
        "3",
        "--spares",
        str(spares),
        str(SCRIPT),
        str(out),
    ]
    job = Job(command, env)
    record: dict = {"trial": index, "kind": kind, "spares": spares}
    if not _wait_step(out, job, rng.randint(8, 40)):
        job.wait(5)
        return {**record, "error": "no progress before the fault", "output": job.output[-2000:]}
    at, survivors = _inject(kind, out, job, rng)
    code = job.wait(timeout_s=240)
    (out / "output.txt").write_text(job.output)
    finals = [json.loads(s[6:]) for _, s in job.lines if s.startswith("FINAL ")]
    detected = job.first(r"live: slot \d+ (died|stopped answering|left)", at)
    healed = job.first(r"healed from slot", at)
    stalls = [float(m) for _, s in job.lines for m in re.findall(r"stall ([\d.]+) s", s)]
    heals = [float(m) for _, s in job.lines for m in re.findall(r"at step \d+ in ([\d.]+) s", s)]
    lost_re = r"discarded on every member after ([\d.]+) s"
    lost = [float(m) for _, s in job.lines for m in re.findall(lost_re, s)]
    failures = sum(
        1
        for _, s in job.lines
        if re.search(
            r"^ddpkit run: live: slot \d+ "
            r"(died|stopped|left)",
            s,
        )
    )
    return {
        **record,
        "exit": code,
        "hang": code == -999,
        "failures": failures,
        "survivors_kept": survivors <= {f["pid"] for f in finals},
        "final_equal": len({f["params_sha256"] for f in finals}) == 1 and len(finals) > 0,
        "discarded_steps": max((f["counters"]["discarded_steps"] for f in finals), default=None),
        "detect_s": detected[0] - at if detected else None,
        "rejoin_s": healed[0] - at if healed else None,
        "stall_s": max(stalls, default=None),
        "failed_op_s": max(lost, default=None),
        "heal_s": max(heals, default=None),
        **_check_logs(out),
    }


def restart_trial(index: int, rng: random.Random, root: Path) -> dict:
    """The same SIGKILL under restart-everything (torchrun restarts every worker, which resume
    from the newest checkpoint): the time from the fault until training is past the step it
    had reached, and the steps trained again."""
    out = root / f"restart-{index:03d}"
    out.mkdir(parents=True)
    env = {"STEP_S": "0.03", "EPOCHS": "8", "CKPT_EVERY": "10"}
    command = [
        sys.executable,
        "-m",
        "ddpkit",
        "run",
        "-n",
        "3",
        "--max-restarts",
        "3",
        str(SCRIPT),
        str(out),
    ]
    job = Job(command, env)
    if not _wait_step(out, job, rng.randint(8, 40)):
        job.wait(5)
        return {"trial": index, "kind": "restart", "error": "no progress"}
    first = set(_slots(out).values())
    at, _ = _inject("kill", out, job, rng)
    deadline = time.monotonic() + 60
    while any(Path(f"/proc/{pid}").exists() for pid in first) and time.monotonic() < deadline:
        time.sleep(0.01)  # torchrun stops the survivors; rank 0 wrote its last step by then
    reached = _step(out)
    (out / "progress").write_text("0")  # the restarted workers write it again
    back = _wait_step(out, job, reached + 1, timeout_s=180)
    back_s = time.monotonic() - at if back else None
    code = job.wait(timeout_s=240)
    (out / "output.txt").write_text(job.output)
    resumed_re = r"resumed from .*\(step (\d+)\)"
    resumed = [int(m) for _, s in job.lines for m in re.findall(resumed_re, s)]
    return {
        "trial": index,
        "kind": "restart",
        "exit": code,
        "back_past_fault_s": back_s,
        "recomputed_steps": reached - max(resumed) if resumed else None,
    }


def _stats(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} / {max(values):.2f}"


def run_trials(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="ddpkit-live-trials-"))
    results = []
    for index in range(args.count):
        kind = KINDS[index % len(KINDS)]
        result = live_trial(index, kind, spares=index % 2, rng=rng, root=root)
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "output"}), flush=True)
    for index in range(args.restart):
        result = restart_trial(index, rng, root)
        results.append(result)
        print(json.dumps(result), flush=True)
    Path(args.json).write_text(json.dumps(results, indent=1))
    live = [r for r in results if r["kind"] != "restart" and "error" not in r]
    restart = [r for r in results if r["kind"] == "restart" and "error" not in r]
    print(
        f"\n{_machine()}; {len(live)} live trials, {len(restart)} restart trials (seed "
        f"{args.seed}); results: {args.json}"
    )
    print("| | live | | |\n|---|---|---|---|")
    print(
        f"| exit 0 | {sum(r['exit'] == 0 for r in live)}/{len(live)} | hangs | "
        f"{sum(r['hang'] for r in live)} |"
    )
    print(
        f"| survivors kept (0 restarts) | {sum(r['survivors_kept'] for r in live)}/{len(live)}"
        f" | forks | {sum(r['forks'] for r in live)} |"
    )
    print(
        f"| final models equal | {sum(r['final_equal'] for r in live)}/{len(live)} | samples "
        f"missing | {sum(r['missing_samples'] for r in live)} |"
    )
    per_failure = [
        r["discarded_steps"] / max(r["failures"], 1)
        for r in live
        if r["discarded_steps"] is not None
    ]
    print(
        f"| steps discarded per failure (max) | {max(per_failure, default=0):.1f} | padding "
        f"repeats | {sum(r['padding_repeats'] for r in live)} |"
    )
    healed = sum(r["rejoin_s"] is not None for r in live)
    print(f"| a replacement healed before the job ended | {healed}/{len(live)} | | |")
    for spares in (0, 1):
        group = [r for r in live if r["spares"] == spares]
        print(
            f"| spares={spares}: detection, failed step, stall, heal, rejoin (median / max s) |"
            f" {_stats([r['detect_s'] for r in group])}, "
            f"{_stats([r['failed_op_s'] for r in group])}, "
            f"{_stats([r['stall_s'] for r in group])}"
            f", {_stats([r['heal_s'] for r in group])}, {_stats([r['rejoin_s'] for r in group])}"
            " | | |"
        )
    if restart:
        print(
            f"| restart mode: fault to training past it (median / max s) | "
            f"{_stats([r['back_past_fault_s'] for r in restart])} | steps trained again | "
            f"{_stats([r['recomputed_steps'] for r in restart])} |"
        )


def _train(
    mode: str,
    out: Path,
    faults_every: float | None,
    minutes: float,
    rng: random.Random,
    nproc: int,
    spares: int = 0,
) -> dict:
    """One digits job for ``minutes`` of epochs, a SIGKILL every ``faults_every`` seconds."""
    epochs = max(int(minutes * 60 / 0.15), 2)  # ~0.15 s an epoch here
    command = [
        sys.executable,
        "-m",
        "ddpkit",
        "train",
        "--nproc",
        str(nproc),
        "--dataset",
        "digits",
        "--epochs",
        str(epochs),
        "--output-dir",
        str(out),
        "--max-restarts",
        "100",
        "--progress",
        "off",
        "--fault-tolerance",
        mode,
    ]
    if mode == "restart":
        command += ["--checkpoint-every", "10"]
    elif spares:
        command += ["--spares", str(spares)]
    job = Job(command, {})
    start = time.monotonic()
    faults = 0
    while job.proc.poll() is None:
        time.sleep(faults_every or 1.0)
        if faults_every is None or job.proc.poll() is not None:
            continue
        workers = _training_workers(job.proc.pid)
        if workers:
            os.kill(rng.choice(workers), signal.SIGKILL)
            faults += 1
    wall = time.monotonic() - start
    job.wait(10)
    (out / "output.txt").write_text(job.output)
    summary = (
        json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    )
    samples = summary.get("train_set_size", 0) * epochs
    return {
        "mode": mode,
        "faults": faults,
        "wall_s": wall,
        "exit": job.proc.returncode,
        "samples_per_wall_s": samples / wall if summary else 0.0,
    }


def _descendants(pid: int) -> set[int]:
    """``pid`` and every process below it."""
    from ddpkit.env import descendant_pids

    return {pid, *descendant_pids(pid)}


def _is_worker(pid: int) -> bool:
    """A worker, or a warm spare (which becomes a worker when it takes over a slot)."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"ddpkit.launch.worker" in command or b"ddpkit.launch.spare" in command


def _cpu_ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return -1


def _training_workers(launcher: int) -> list[int]:
    """Worker processes that train now (CPU time grew over 0.5 s): not an idle warm spare."""
    candidates = [p for p in _descendants(launcher) if _is_worker(p)]
    before = {p: _cpu_ticks(p) for p in candidates}
    time.sleep(0.5)
    return [p for p in candidates if _cpu_ticks(p) - before[p] >= 5]


def run_goodput(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="ddpkit-live-goodput-"))
    rows = []
    for mode in ("live", "restart"):
        clean = _train(
            mode, root / f"{mode}-clean", None, args.minutes, rng, args.nproc, args.spares
        )
        print(json.dumps({"mode": mode, "clean": clean}), flush=True)
        for every in args.every:
            faulty = _train(
                mode,
                root / f"{mode}-faults-{every:g}",
                every,
                args.minutes,
                rng,
                args.nproc,
                args.spares,
            )
            ratio = (
                faulty["samples_per_wall_s"] / clean["samples_per_wall_s"]
                if clean["samples_per_wall_s"]
                else float("nan")
            )
            rows.append((mode, every, clean, faulty, ratio))
            print(
                json.dumps({"mode": mode, "every_s": every, "faults": faulty, "goodput": ratio}),
                flush=True,
            )
    print(
        f"\n{_machine()}; digits, {args.nproc} ranks (live: {args.spares} warm spare(s)), "
        f"{args.minutes:g} min of epochs, a SIGKILL to a random worker every N s; outputs in "
        f"{root}"
    )
    print("| mode | N (s) | faults | wall with faults (s) | wall without (s) | goodput |")
    print("|---|---|---|---|---|---|")
    for mode, every, clean, faulty, ratio in rows:
        print(
            f"| {mode} | {every:g} | {faulty['faults']} | {faulty['wall_s']:.1f} (exit "
            f"{faulty['exit']}) | {clean['wall_s']:.1f} | {ratio:.3f} |"
        )


def run_cost(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="ddpkit-live-cost-"))
    data = (
        ["--dataset", "digits", "--epochs", "30"]
        if args.data_dir is None
        else ["--data-dir", args.data_dir, "--epochs", "1"]
    )
    rates: dict[str, list[float]] = {"live": [], "restart": []}
    for round_ in range(args.rounds):
        for mode in ("restart", "live") if round_ % 2 else ("live", "restart"):
            out = root / f"{mode}-{round_}"
            command = [
                sys.executable,
                "-m",
                "ddpkit",
                "train",
                "--nproc",
                "2",
                *data,
                "--output-dir",
                str(out),
                "--progress",
                "off",
                "--fault-tolerance",
                mode,
            ]
            job = Job(command, {})
            job.wait(900)
            rates[mode].append(json.loads((out / "summary.json").read_text())["samples_per_s"])
            print(mode, round(rates[mode][-1]), flush=True)
    live, restart = statistics.median(rates["live"]), statistics.median(rates["restart"])
    print(f"\n{_machine()}; {' '.join(data)}, 2 ranks, {args.rounds} interleaved rounds")
    print(
        f"samples/s median: live {live:.0f}, restart {restart:.0f}; live/restart "
        f"{live / restart:.3f}; each: live {[round(r) for r in rates['live']]}, restart "
        f"{[round(r) for r in rates['restart']]}"
    )


def _machine() -> str:
    import torch

    return f"{os.cpu_count()} cores, {platform.python_version()}, torch {torch.__version__}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    trials = sub.add_parser("trials")
    trials.add_argument("--count", type=int, default=50)
    trials.add_argument("--restart", type=int, default=10, help="restart-mode trials")
    trials.add_argument("--seed", type=int, default=0)
    trials.add_argument("--json", default="live_trials.json")
    goodput = sub.add_parser("goodput")
    goodput.add_argument("--every", type=float, nargs="+", default=[60.0, 15.0])
    goodput.add_argument("--minutes", type=float, default=3.0)
    goodput.add_argument("--seed", type=int, default=0)
    goodput.add_argument("--nproc", type=int, default=2)
    goodput.add_argument("--spares", type=int, default=1, help="live mode's warm spares")
    cost = sub.add_parser("cost")
    cost.add_argument("--rounds", type=int, default=5)
    cost.add_argument("--data-dir", default=None, help="MNIST files: one epoch of MNIST instead")
    args = parser.parse_args()
    {"trials": run_trials, "goodput": run_goodput, "cost": run_cost}[args.what](args)


if __name__ == "__main__":
    main()
