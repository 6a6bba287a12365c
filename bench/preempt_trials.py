"""Preemption trials: ``ddpkit train`` signalled at a random moment, then resumed.

    python bench/preempt_trials.py --trials 100          # about 20 minutes on 2 busy cores

One uninterrupted reference run first (2 ranks, digits, ``--epochs 10``: 120 steps); then each
trial starts the same job and picks a random moment: in one trial of four a time uniform over
the reference's start-up (launch to its first step record: importing torch, the rendezvous,
the data); else a step uniform in 1..115, and once its record is written, a further 0-30 ms
(so some land in a checkpoint write or an evaluation). Then it sends a random stop signal
(SIGTERM, SIGUSR1, SIGINT) to a random target: the launcher, one rank, or every process of the
job (as Slurm signals a job step). It checks:

- no deadlock: the job ends within ``--deadline`` seconds of the signal;
- no SIGKILL escalation: every rank stopped by itself within the grace period (the stop line
  does not say "killed (SIGKILL)", torchrun did not log "forcefully exiting");
- the exit status is 128 + the signal (0 when the job had finished before the signal);
- the newest checkpoint verifies and is at the step the line names; no ``.tmp-*`` is left;
- 0 lost steps: the resume command from the line resumes at exactly that step;
- the resumed run's ``model.pt`` is bitwise equal to the reference's; no process outlives a run.

Prints one line per trial, a table by target, and the signal-to-exit median and max.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from ddpkit.checkpoint.io import list_checkpoints, load_checkpoint

EPOCHS, STEPS_PER_EPOCH = 10, 12
JOB = [
    "-m",
    "ddpkit",
    "train",
    "--dataset",
    "digits",
    "--nproc",
    "2",
    "--epochs",
    str(EPOCHS),
    "--checkpoint-every",
    "50",
    "--log-every",
    "1",
    "--progress",
    "off",
    "--tensorboard",
    "off",
]
TOTAL_STEPS = EPOCHS * STEPS_PER_EPOCH
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
TARGETS = ("launcher", "one rank", "every process")
LINE = re.compile(
    r"after step (\d+) .*?(?:; saved: checkpoint (step-\d+) in (\S+))?"
    r"(?:; resume with: (.+))?$"
)


def _tree(pid: int) -> set[int]:
    """``pid`` and every process below it."""
    from ddpkit.env import descendant_pids

    return {pid, *descendant_pids(pid)}


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _workers(pid: int) -> list[int]:
    found = []
    for child in _tree(pid) - {pid}:
        try:
            if b"ddpkit.launch.worker" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
        except OSError:
            continue
    return found


def _run(argv: list[str], out: Path, timeout_s: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, *argv, "--output-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
    )


def _signal(proc: subprocess.Popen, target: str, sig: signal.Signals, rng: random.Random) -> str:
    workers = _workers(proc.pid)
    if target == "launcher" or not workers:
        pids = [proc.pid]
    elif target == "one rank":
        pids = [rng.choice(workers)]
    else:
        pids = sorted(_tree(proc.pid))
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return "launcher" if pids == [proc.pid] else target


def _wait_first_step(proc: subprocess.Popen, out: Path) -> None:
    steps = out / "steps.jsonl"
    while proc.poll() is None and not (steps.exists() and steps.stat().st_size):
        time.sleep(0.01)


def _wait_step(proc: subprocess.Popen, out: Path, step: int) -> None:
    """Until the record of ``step`` (or a later one) is in steps.jsonl, or the job ended."""
    steps = out / "steps.jsonl"
    while proc.poll() is None:
        lines = steps.read_text().splitlines() if steps.exists() else []
        if lines and lines[-1].endswith("}") and json.loads(lines[-1])["step"] >= step:
            return
        time.sleep(0.005)


def _stopped_run(workdir: Path, delay: tuple, target: str, sig: signal.Signals, rng, deadline):
    out = workdir / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, *JOB, "--output-dir", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    phase, value = delay
    if phase == "training":
        _wait_step(proc, out, value)
        time.sleep(rng.uniform(0, 0.03))
    else:
        time.sleep(value)
    tree = _tree(proc.pid)
    finished = proc.poll() is not None
    sent_at = time.monotonic()
    hit = "none (finished)" if finished else _signal(proc, target, sig, rng)
    try:
        _, errors = proc.communicate(timeout=deadline)
        exit_s = time.monotonic() - sent_at
    except subprocess.TimeoutExpired:
        for pid in _tree(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.communicate()
        return {"deadlock": True, "hit": hit, "exit_s": deadline, "errors": ""}
    orphans = [pid for pid in tree | _tree(proc.pid) if pid != proc.pid and _alive(pid)]
    return {
        "deadlock": False,
        "hit": hit,
        "finished": finished,
        "code": proc.returncode,
        "exit_s": exit_s,
        "errors": errors,
        "orphans": orphans,
        "out": out,
    }


def trial(rng: random.Random, workdir: Path, reference: dict, phases: tuple, deadline: float):
    target, sig = rng.choice(TARGETS), rng.choice(SIGNALS)
    startup_s, training_s = phases
    start_up = rng.random() < 0.25
    delay = (
        ("start-up", rng.uniform(0, startup_s))
        if start_up
        else ("training", rng.randint(1, TOTAL_STEPS - 5))
    )
    got = _stopped_run(workdir, delay, target, sig, rng, deadline)
    row = {
        "target": got["hit"],
        "signal": sig.name,
        "phase": delay[0],
        "delay_s": delay[1],
        "exit_s": got["exit_s"],
    }
    problems = []
    if got["deadlock"]:
        return {**row, "problems": ["deadlock"], "step": None}
    errors = got["errors"]
    last = errors.strip().splitlines()[-1] if errors.strip() else ""
    if "killed (SIGKILL)" in last or "forcefully exiting" in errors:
        problems.append("SIGKILL escalation")
    if got["orphans"]:
        problems.append(f"orphans {got['orphans']}")
    step, resume = _check_line(got, sig, last, problems)
    row["step"], row["target"] = step, got["hit"]
    if not problems:
        _check_resume(got["out"], step, resume, reference, problems)
    return {**row, "problems": problems}


def _check_line(got: dict, sig: signal.Signals, last: str, problems: list) -> tuple:
    completed = got["code"] == 0 and (got["out"] / "summary.json").is_file()
    if got["finished"] or completed:  # it ended before the signal, or before a step answered
        if got["code"] != 0:
            problems.append(f"exit {got['code']}")
        got["hit"] += "" if got["finished"] else " (completed)"
        return TOTAL_STEPS, None
    if got["code"] == -sig and not (got["out"] / "checkpoints").exists():
        # the launcher was still importing torch: the signal's usual effect (Python's Ctrl-C
        # traceback, or death by the signal: 128 + N to a shell); no rank had started
        got["hit"] += " (launcher start-up)"
        return 0, None
    if got["code"] != 128 + sig:
        problems.append(f"exit {got['code']} (expected {128 + sig}): {last}")
    found = LINE.search(last)
    if not found:
        if "before the ranks agreed" in last:  # stopped during start-up: nothing trained
            return 0, None
        problems.append(f"no stop line: {last!r}")
        return None, None
    step, folder, directory, resume = found.groups()
    step = int(step)
    if folder is not None:
        newest = list_checkpoints(Path(directory))[0]
        if newest.name != folder or folder != f"step-{step:08d}":
            problems.append(f"newest checkpoint {newest.name}, line says {folder} at {step}")
        try:
            load_checkpoint(newest)
        except Exception as exc:  # noqa: BLE001 - a corrupt checkpoint is a finding
            problems.append(f"corrupt checkpoint: {exc}")
        if list(Path(directory).glob(".tmp-*")):
            problems.append("a .tmp- folder left behind")
    elif step > 0:
        problems.append(f"stopped after step {step} without a checkpoint: {last}")
    return step, resume


def _check_resume(out: Path, step: int, resume: str | None, reference: dict, problems: list):
    argv = shlex.split(resume)[1:] if resume else JOB[2:]
    argv = [a for i, a in enumerate(argv) if a != "--output-dir" and argv[i - 1] != "--output-dir"]
    if step >= TOTAL_STEPS:  # finished before the signal: compare its own model
        result = None
    else:
        result = _run(["-m", "ddpkit", *argv], out)
        if result.returncode != 0:
            problems.append(f"resume failed: {result.stderr.strip().splitlines()[-1:]}")
            return
        if resume and f"(step {step})" not in result.stdout:
            problems.append(f"resumed elsewhere than step {step}")
    model = torch.load(out / "model.pt", weights_only=True)
    if not all(torch.equal(reference[k], model[k]) for k in reference):
        problems.append("final model differs from the uninterrupted run")


def _reference(out: Path) -> tuple[dict, tuple[float, float]]:
    """The uninterrupted run's model, and its (start-up, training) seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, *JOB, "--output-dir", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    _wait_first_step(proc, out)
    first = time.monotonic()
    _, errors = proc.communicate(timeout=600)
    assert proc.returncode == 0, errors
    phases = (first - start, time.monotonic() - first)
    return torch.load(out / "model.pt", weights_only=True), phases


def _table(rows: list[dict]) -> None:
    by = defaultdict(list)
    for row in rows:
        by[row["target"]].append(row)
    print(f"\n{'target':<16}{'trials':>7}{'passed':>8}{'exit s median':>15}{'exit s max':>12}")
    for target, group in sorted(by.items()):
        times = [r["exit_s"] for r in group if not r["target"].startswith("none")]
        med = f"{statistics.median(times):.2f}" if times else "-"
        top = f"{max(times):.2f}" if times else "-"
        ok = sum(1 for r in group if not r["problems"])
        print(f"{target:<16}{len(group):>7}{ok:>8}{med:>15}{top:>12}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deadline", type=float, default=90.0, help="seconds: a deadlock")
    args = parser.parse_args()
    # A shell's background job ignores SIGINT, and so would every job started from it: give the
    # jobs a terminal's Ctrl-C (a Python handler here becomes the default in the children).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="ddpkit-preempt-") as tmp:
        reference, phases = _reference(Path(tmp) / "ref")
        print(f"reference run: start-up {phases[0]:.1f} s, then {phases[1]:.1f} s to the end")
        rows = []
        for number in range(args.trials):
            workdir = Path(tmp) / f"trial-{number}"
            row = trial(rng, workdir, reference, phases, args.deadline)
            rows.append(row)
            status = "ok" if not row["problems"] else "FAIL " + "; ".join(row["problems"])
            when = (
                f"start-up +{row['delay_s']:.1f} s"
                if row["phase"] == "start-up"
                else f"step {row['delay_s']:3d}"
            )
            print(
                f"trial {number:3d}: {row['signal']:<7} to {row['target']:<15} at {when}, "
                f"stopped after step {row['step']}, exit {row['exit_s']:.2f} s later: "
                f"{status}",
                flush=True,
            )
    _table(rows)
    signalled = [r["exit_s"] for r in rows if not r["target"].startswith("none")]
    failed = [r for r in rows if r["problems"]]
    print(
        f"\n{len(rows)} trials, {len(rows) - len(failed)} passed, {len(failed)} failed; "
        f"signal to exit: median {statistics.median(signalled):.2f} s, max "
        f"{max(signalled):.2f} s ({len(signalled)} signalled)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
