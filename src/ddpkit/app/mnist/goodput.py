"""Where the wall time of ``ddpkit train`` went, over every attempt of a run: the goodput.

An attempt is one start of the job in an output folder: the first run, each torchrun restart
(``--max-restarts``), each rerun with ``--resume``. Rank 0 keeps one record per attempt in
``OUTPUT_DIR/attempts/attempt-NNN.json``, rewritten in place after every step (one ``pwrite``
of a fixed-size line, no fsync: it survives the process being killed, not the machine), so an
attempt that was SIGKILLed still tells how far it got. A fresh run removes the folder.

The split, summed over the attempts, in seconds (``summary.json``'s ``goodput`` and the last
log line):

- ``productive_s``: training steps whose result the run kept;
- ``checkpoint_s``: checkpoint writes;
- ``startup_s``: restarts and rendezvous: from each process's start (Linux: its start time in
  ``/proc``) to its first step, plus, for a torchrun restart, the gap since the failed attempt's
  last record;
- ``recomputed_s`` / ``recomputed_steps``: steps an attempt trained past the checkpoint the next
  attempt resumed from, trained again (their time: that attempt's mean step time);
- ``evaluation_s``; ``other_s``: the rest (epoch-end collectives, logging, writing outputs);
- ``goodput``: productive / wall, the ratio fault-tolerance papers compare (torchft reports 81 %
  at one failure a minute). A rerun's wall time starts at its own process start: the time
  between a stop and the rerun (the queue) is not counted.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from ddpkit.runtime.process_group import Runtime

FOLDER = "attempts"
RECORD_BYTES = 512
_IMPORTED_AT = time.time()


def process_start_time() -> float:
    """When this process started, as a Unix time (Linux ``/proc``; elsewhere: when this module
    was imported)."""
    try:
        with open("/proc/self/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as handle:
            uptime_s = float(handle.read().split()[0])
        return time.time() - (uptime_s - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT


class Goodput:
    """This attempt's time split, written by rank 0 after every step; the run's total at the end.

    Args:
        output_dir: the run's output folder.
        runtime: the job's runtime (only rank 0 writes).
        resumed_step: the step this attempt started from (0: a fresh run, unless restarted).
    """

    def __init__(self, output_dir: Path, runtime: Runtime, resumed_step: int) -> None:
        self.folder = output_dir / FOLDER
        self.runtime = runtime
        # live fault tolerance: rank 0 may change hands; each process keeps its own split
        self.writer = runtime.is_rank_zero and runtime.live is None
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if self.writer and resumed_step == 0 and restart == 0:
            shutil.rmtree(self.folder, ignore_errors=True)  # a fresh run
        self.record: dict[str, Any] = {
            "restart": restart,
            "start_time": process_start_time(),
            "resumed_step": resumed_step,
            "furthest_step": resumed_step,
            "startup_s": 0.0,
            "loop_s": 0.0,
            "checkpoint_s": 0.0,
            "evaluation_s": 0.0,
            "last_time": time.time(),
            "end": "",
        }
        self._fd = self._open() if self.writer else None
        self._last: float | None = None

    def _open(self) -> int:
        self.folder.mkdir(parents=True, exist_ok=True)
        number = len(list(self.folder.glob("attempt-*.json")))
        path = self.folder / f"attempt-{number:03d}.json"
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def start_steps(self) -> None:
        """Before the first step of an epoch: time from here to each step is training."""
        now = time.perf_counter()
        if self.record["startup_s"] == 0.0:
            self.record["startup_s"] = time.time() - self.record["start_time"]
        self._last = now

    def on_step(self, step: int, checkpoint_s: float) -> None:
        """After step ``step``; ``checkpoint_s``: the checkpoint manager's write time so far."""
        now = time.perf_counter()
        if self._last is not None:
            self.record["loop_s"] += now - self._last
        self._last = now
        self.record.update(furthest_step=step, checkpoint_s=checkpoint_s)
        self._write()

    def add_evaluation(self, seconds: float) -> None:
        self.record["evaluation_s"] += seconds
        self._last = None  # the next epoch's first step starts the clock again

    def finish(self, end: str, checkpoint_s: float) -> dict[str, Any]:
        """Close this attempt (``end``: ``"completed"`` or ``"stopped"``); the run's split over
        every attempt (rank 0; ``{}`` elsewhere)."""
        if self._last is not None:  # since the last step: its checkpoint write (a stop's)
            self.record["loop_s"] += time.perf_counter() - self._last
            self._last = None
        self.record.update(end=end, checkpoint_s=checkpoint_s)
        self._write()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        live = self.runtime.live
        if live is not None:
            self.record["last_time"] = time.time()
            return live_split(self.record, vars(live.counters)) if self.runtime.is_rank_zero else {}
        return summarize(read_attempts(self.folder)) if self.writer else {}

    def so_far(self) -> float | None:
        """The run's goodput through the last step (productive over wall time, every attempt
        so far; rank 0, ``None`` elsewhere and with live fault tolerance)."""
        if not self.writer:
            return None
        return summarize(read_attempts(self.folder)).get("goodput")

    def _write(self) -> None:
        if self._fd is None:
            return
        self.record["last_time"] = time.time()
        line = json.dumps(self.record).encode()
        os.pwrite(self._fd, line.ljust(max(RECORD_BYTES, len(line) + 1)), 0)


def read_attempts(folder: Path) -> list[dict[str, Any]]:
    """The attempt records in ``folder``, oldest first (a record cut short is skipped)."""
    records = []
    for path in sorted(folder.glob("attempt-*.json")):
        try:
            records.append(json.loads(path.read_bytes().decode().strip()))
        except (OSError, ValueError):
            continue
    return records


def summarize(attempts: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's time split over ``attempts`` (see the module docstring); seconds."""
    totals = dict.fromkeys(("startup_s", "checkpoint_s", "evaluation_s"), 0.0)
    productive = recomputed = wall = 0.0
    recomputed_steps = 0
    for index, attempt in enumerate(attempts):
        wall += attempt["last_time"] - attempt["start_time"]
        for key in totals:
            totals[key] += attempt[key]
        steps_s = max(attempt["loop_s"] - attempt["checkpoint_s"], 0.0)
        nxt = attempts[index + 1] if index + 1 < len(attempts) else None
        lost = max(attempt["furthest_step"] - nxt["resumed_step"], 0) if nxt else 0
        trained = max(attempt["furthest_step"] - attempt["resumed_step"], 1)
        lost_s = steps_s * min(lost / trained, 1.0)
        productive += steps_s - lost_s
        recomputed += lost_s
        recomputed_steps += lost
        if nxt is not None and nxt["restart"] > attempt["restart"]:  # torchrun's restart gap
            gap = max(nxt["start_time"] - attempt["last_time"], 0.0)
            totals["startup_s"] += gap
            wall += gap
    other = wall - productive - recomputed - sum(totals.values())
    return {
        "wall_s": wall,
        "productive_s": productive,
        **totals,
        "recomputed_s": recomputed,
        "recomputed_steps": recomputed_steps,
        "other_s": max(other, 0.0),
        "goodput": productive / wall if wall > 0 else None,
        "attempts": len(attempts),
        "restarts": sum(1 for a in attempts if a["restart"] > 0),
    }


def live_split(record: dict[str, Any], counters: dict[str, Any]) -> dict[str, Any]:
    """The time split of one process of a live fault-tolerant run (the one that is rank 0 at
    the end; a replacement's wall time starts at its own start): :func:`summarize`'s keys, with
    ``recovery_s`` (quorum changes: the failed operations and the moves to the next quorum)
    taken out of the training time, steps discarded counted at the mean step time, and the
    live counters (failures, discarded steps, stall, heal time) under ``live``."""
    wall = record["last_time"] - record["start_time"]
    steps = max(record["furthest_step"] - record["resumed_step"], 1)
    recovery = min(counters["stall_s"], record["loop_s"])
    steps_s = max(record["loop_s"] - record["checkpoint_s"] - recovery, 0.0)
    discarded_s = steps_s * min(counters["discarded_steps"] / steps, 1.0)
    productive = steps_s - discarded_s
    known = productive + discarded_s + recovery + record["checkpoint_s"]
    known += record["startup_s"] + record["evaluation_s"]
    return {
        "wall_s": wall,
        "productive_s": productive,
        "startup_s": record["startup_s"],
        "checkpoint_s": record["checkpoint_s"],
        "evaluation_s": record["evaluation_s"],
        "recomputed_s": discarded_s,
        "recomputed_steps": counters["discarded_steps"],
        "recovery_s": recovery,
        "other_s": max(wall - known, 0.0),
        "goodput": productive / wall if wall > 0 else None,
        "attempts": 1,
        "restarts": 0,
        "live": counters,
    }


def goodput_line(split: dict[str, Any]) -> str:
    """The last log line: ``goodput 0.87: productive 35.0 s of 40.1 s wall; ...``."""
    if not split or split["goodput"] is None:
        return "goodput: no time measured"
    if "live" in split:
        live = split["live"]
        return (
            f"goodput {split['goodput']:.2f}: productive steps {split['productive_s']:.1f} s of "
            f"{split['wall_s']:.1f} s wall (this process); live fault tolerance: "
            f"{live['failures']} failure(s) survived, {split['recomputed_steps']} step(s) "
            f"discarded, recovery {split['recovery_s']:.2f} s, heal {live['heal_s']:.2f} s; "
            f"checkpoints {split['checkpoint_s']:.1f} s, start-up {split['startup_s']:.1f} s, "
            f"evaluation {split['evaluation_s']:.1f} s, other {split['other_s']:.1f} s"
        )
    return (
        f"goodput {split['goodput']:.2f}: productive steps {split['productive_s']:.1f} s of "
        f"{split['wall_s']:.1f} s wall; checkpoints {split['checkpoint_s']:.1f} s, start-up and "
        f"restarts {split['startup_s']:.1f} s, recomputed {split['recomputed_s']:.1f} s "
        f"({split['recomputed_steps']} steps), evaluation {split['evaluation_s']:.1f} s, other "
        f"{split['other_s']:.1f} s ({split['attempts']} attempt(s), {split['restarts']} "
        "restart(s))"
    )
