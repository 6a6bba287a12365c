"""Watchdog: turn a hang into a report that names each rank's collective and source line.

Each rank runs one background thread, on by default (:func:`ddpkit.init_runtime`). Every
``interval_s`` it samples the training thread's Python stack and classifies it
(:func:`ddpkit.watchdog.position.locate`): blocked in a torch.distributed collective (which
operation, group, sequence number, tensor, and the user's ``file:line``), in ``backward()``
waiting for DDP's gradient all-reduce, or running other code. No markers are needed: torch's own
collectives on any group, DDP's and ddpkit's are all seen. The position goes into the rank's
heartbeat in the rendezvous store. Then, while this rank is blocked:

- **deadlock**: every rank is blocked and no collective has all of its group's ranks in it
  (:func:`ddpkit.watchdog.stall_report.find_deadlock`) -- the ranks called different
  operations, groups or numbers of collectives, so none can ever finish. Once every rank has
  stayed put for ``deadlock_timeout_s`` (default 5 s) this is reported and the job ends;
- **stall**: this rank has waited in one place longer than ``stall_timeout_s`` (default 300 s)
  while some rank is busy elsewhere (rank 0 downloading?). That may be legitimate, hence the long
  threshold; the report shows the busy rank's stack and the fix (``rt.main_process_first()``, or
  a higher threshold).

A report asks every rank for its Python stack, is printed with a ``[rank r/N]`` prefix and
recorded for ``ddpkit run``'s summary; then every rank exits with status 1. The training thread
is blocked inside the collective, where Python cannot raise, so ending the process is the only
way out.

Cost when nothing is wrong, per ``interval_s``: one stack walk of a few dozen frames and one
small store write; the peers' heartbeats are read only while this rank stays blocked.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from ddpkit.env import ProcessInfo
from ddpkit.errors import ConfigError, DistributedError
from ddpkit.log import get_logger
from ddpkit.watchdog.position import RUNNING, Position, locate, sequence_number
from ddpkit.watchdog.stall_report import (
    StallReport,
    deadlock_report,
    describe,
    find_deadlock,
    stall_report,
)

__all__ = ["DeadlockError", "StallError", "StallReport", "Watchdog", "main_thread_stack"]

PREFIX = "ddpkit/watchdog"
MAX_STACK_FRAMES = 12
IDLE_CPU_FRACTION = 0.1  # the process used under 10% of one core: idle
READ_BEATS_EVERY = 10  # ticks; more often while this rank stays blocked


class StallError(DistributedError):
    """A rank waited past the stall timeout (the watchdog's report is the message)."""


class DeadlockError(StallError):
    """The ranks wait in collectives that can never match (the report is the message)."""


def main_thread_stack(thread_id: int) -> str:
    """The formatted stack of thread ``thread_id`` (its last frames, without ddpkit's launch
    bootstrap and runpy), or ``""`` if the thread is gone."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return ""
    skip = ("ddpkit/launch/worker.py", "runpy", "<frozen runpy>")
    frames = [f for f in traceback.extract_stack(frame) if not f.filename.endswith(skip)]
    return "".join(traceback.format_list(frames[-MAX_STACK_FRAMES:]))


class Watchdog:
    """Per-rank deadlock and stall detector; see the module docstring.

    Args:
        store: the job's rendezvous store (shared by all ranks: a ``TCPStore`` or ``FileStore``).
        info: this process's rank and world size.
        stall_timeout_s: report a rank that waits this long while another is busy, in seconds;
            ``None``: never.
        deadlock_timeout_s: report a deadlock once every rank has been stuck in it this long,
            in seconds; ``None``: never.
        interval_s: heartbeat period, in seconds; a rank counts as silent after ``2 *
            interval_s + 1`` seconds without a new one.
        on_stall: called (in the watchdog thread) with the :class:`StallReport`; the default
            prints it, records it and ends the process (exit status 1).
        groups: process groups whose sequence numbers count as progress (e.g. the training
            group; the default group always counts). Held by weak reference.
        group_labels: group name -> how reports call it (``"the default group"``).
        recorder: called with the :class:`StallError` before the default ``on_stall`` ends the
            process (``init_runtime`` passes :func:`ddpkit.diagnostics.failures.record_failure`,
            which writes the launcher's failure record); ``None``: nothing recorded.

    Raises:
        ConfigError: ``interval_s`` not positive, or a timeout below two intervals.
    """

    def __init__(
        self,
        store: dist.Store,
        info: ProcessInfo,
        stall_timeout_s: float | None = 300.0,
        *,
        deadlock_timeout_s: float | None = 5.0,
        interval_s: float = 1.0,
        on_stall: Callable[[StallReport], None] | None = None,
        groups: tuple[Any, ...] = (),
        group_labels: dict[str, str] | None = None,
        recorder: Callable[[BaseException], None] | None = None,
    ) -> None:
        timeouts = [t for t in (stall_timeout_s, deadlock_timeout_s) if t is not None]
        if not interval_s > 0 or not all(t >= 2 * interval_s for t in timeouts):
            raise ConfigError(
                f"invalid watchdog timing: stall_timeout_s={stall_timeout_s!r}, "
                f"deadlock_timeout_s={deadlock_timeout_s!r}, interval_s={interval_s!r}. Each "
                "timeout must be at least two heartbeat intervals, e.g. 300, 5 and 1."
            )
        self.info = info
        self.stall_timeout_s = stall_timeout_s
        self.deadlock_timeout_s = deadlock_timeout_s
        self.interval_s = float(interval_s)
        self.on_stall = on_stall or self._report_and_exit
        self.group_labels = dict(group_labels or {})
        self.recorder = recorder
        self.eval_batches: list[int] | None = None  # the last uneven eval loader's, by rank
        self._groups = [weakref.ref(g) for g in groups if g is not None]
        self._store = dist.PrefixStore(PREFIX, store)
        self._thread_id = threading.get_ident()
        self._labels: list[tuple[str, bool]] = []  # rt.watch blocks: (name, stall check on)
        self._signature: tuple | None = None
        self._since = time.monotonic()  # when the training thread reached its current place
        self._cpu_at, self._wall_at = time.process_time(), time.monotonic()
        self._ticks = 0
        self._answered_dump = self._fired = False
        self._beats: dict[int, dict] = {}  # rank -> its latest heartbeat
        self._heard_at: dict[int, float] = {}  # rank -> local monotonic time of its last new beat
        self._store_ok_at = time.monotonic()
        self._host = socket.gethostname()
        self._stop = threading.Event()
        self._ending = threading.Event()  # this thread is about to end the process
        self._thread = threading.Thread(target=self._run, name="ddpkit-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the background thread (idempotent, returns within ~1 s). Not a collective."""
        self._stop.set()
        if self._thread.is_alive() and threading.get_ident() != self._thread.ident:
            self._thread.join(timeout=1.0)  # a daemon: never keeps the process alive anyway

    def wait_if_ending(self, limit_s: float = 10.0) -> None:
        """Block while this watchdog ends the process after a report (it will, within seconds).

        The collective a report ends fails on the training thread as soon as the first rank
        exits ("Connection closed by peer"); :meth:`ddpkit.Runtime.__exit__` calls this so that
        consequence is not printed and recorded as if it were the cause.
        """
        if self._ending.is_set():
            time.sleep(limit_s)

    @contextmanager
    def watch(self, op: str, *, stall_check: bool = True) -> Iterator[None]:
        """Name the enclosed code in reports (not needed for detection).

        ``stall_check=False`` declares a wait that may legitimately outlast the stall timeout
        (``Runtime.main_process_first``): no stall report there; deadlocks are still reported.
        """
        self._labels.append((op, stall_check))
        try:
            yield
        finally:
            self._labels.pop()

    # --- background thread --------------------------------------------------------------------
    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(self.interval_s):
            try:
                self._tick()
                failures = 0
            except Exception:  # the store is gone (job ending, rank 0 died): stop watching
                failures += 1
                if failures >= 3:
                    return

    def _tick(self) -> None:
        now = time.monotonic()
        position = self._sample(now)
        still_s = now - self._since
        labels = list(self._labels)  # a snapshot: the training thread pushes and pops
        label = labels[-1][0] if labels else ""
        beat = {
            **position.to_json(),
            "still_s": round(still_s, 1),
            "label": label,
            "time_s": time.time(),
            "pid": os.getpid(),
            "host": self._host,
        }
        self._store.set(f"beat/{self.info.rank}", json.dumps(beat))
        self._store_ok_at = now
        self._serve_requests()
        self._ticks += 1
        if self._fired or self._stop.is_set():
            return
        stays = position.blocked and still_s >= self.interval_s
        # the first beats, then one in READ_BEATS_EVERY: what lost_contact() reports later
        if stays or self._ticks <= 3 or self._ticks % READ_BEATS_EVERY == 0:
            self._read_beats()
        if stays and not self._check_deadlock(position, still_s):
            self._check_stall(position, still_s, all(check for _, check in labels))

    def _sample(self, now: float) -> Position:
        """Where the training thread is now; restarts the clock when it moved or progressed."""
        cpu = time.process_time()
        idle = cpu - self._cpu_at < IDLE_CPU_FRACTION * (now - self._wall_at)
        self._cpu_at, self._wall_at = cpu, now
        position = locate(sys._current_frames().get(self._thread_id), idle=idle)
        signature = (position.key, position.site, self._progress())
        if signature != self._signature:
            self._signature, self._since = signature, now
        return position

    def _progress(self) -> tuple:
        """The sequence numbers of the watched groups: they move with every collective (DDP's
        bucket all-reduces included), so a rank that waits again and again is not stuck."""
        if not dist.is_initialized():
            return ()
        groups = [dist.group.WORLD, *(ref() for ref in self._groups)]
        return tuple(sequence_number(g) for g in groups if g is not None)

    def _serve_requests(self) -> None:
        """Answer a stack request; on another rank's report, end this process with it."""
        if not self._store.check(["request"]):
            return
        request = self._store.get("request").decode()
        if not self._answered_dump:
            self._answered_dump = True
            self._store.set(f"stack/{self.info.rank}", main_thread_stack(self._thread_id))
        if request.startswith("abort\n"):
            self._fired = True
            self._ending.set()
            headline = request.split("\n", 1)[1]
            kind = DeadlockError if headline.startswith("deadlock") else StallError
            self._leave_in_order()
            self._exit(kind(f"stopped by another rank's watchdog: {headline}"))

    def _read_beats(self) -> None:
        """Fetch every rank's heartbeat (one round trip once all exist); note which are new.

        Ages are measured on this machine's clock, from when a new beat was first seen, so
        clocks that differ between nodes do not matter.
        """
        keys = [f"beat/{r}" for r in range(self.info.world_size)]
        values: Sequence[bytes | None]
        if self._store.check(keys):
            values = self._store.multi_get(keys)
        else:  # still starting: fetch the ones that exist
            values = [self._store.get(k) if self._store.check([k]) else None for k in keys]
        now = time.monotonic()
        for rank, value in enumerate(values):
            if value is None:
                continue
            beat = json.loads(value)
            if beat != self._beats.get(rank):
                self._beats[rank], self._heard_at[rank] = beat, now
        self._heard_at[self.info.rank] = now

    def _fresh_positions(self) -> dict[int, tuple[Position, float]]:
        """rank -> (position, seconds it has stayed there) for every rank heard recently."""
        silent_after_s = 2 * self.interval_s + 1
        return {
            rank: (Position.from_json(beat), float(beat.get("still_s", 0.0)))
            for rank, beat in dict(self._beats).items()  # a copy: the watchdog's thread writes it
            if rank != self.info.rank and (self.silent_s(rank) or 0.0) <= silent_after_s
        }

    def _check_deadlock(self, mine: Position, still_s: float) -> bool:
        if self.deadlock_timeout_s is None:
            return False
        found = {**self._fresh_positions(), self.info.rank: (mine, still_s)}
        positions = {rank: position for rank, (position, _) in found.items()}
        if not find_deadlock(positions, self.info.world_size):
            return False
        waited_s = min(stayed for _, stayed in found.values())
        if waited_s < self.deadlock_timeout_s:
            return False
        report = deadlock_report(
            self.info.rank, positions, waited_s, self.group_labels, self.eval_batches
        )
        self._fire(report)
        return True

    def _check_stall(self, mine: Position, still_s: float, stall_check: bool) -> bool:
        if self.stall_timeout_s is None or not stall_check or still_s <= self.stall_timeout_s:
            return False
        silent_after_s = 2 * self.interval_s + 1
        peers = {}
        for rank in range(self.info.world_size):
            if rank != self.info.rank:
                beat, age = self._beats.get(rank), self.silent_s(rank)
                position = Position.from_json(beat) if beat else None
                peers[rank] = (position, age if age is not None and age > silent_after_s else None)
        report = stall_report(
            self.info.rank, self.info.world_size, mine, still_s, peers, self.group_labels
        )
        self._fire(report, recheck=True)
        return True

    def _fire(self, report: StallReport, recheck: bool = False) -> None:
        """Gather the stacks and hand the report on, unless the wait ended meanwhile (a slow
        collective: warned once) or another rank already reports (it tells us to stop)."""
        signature = self._signature
        report.stacks = self._gather_stacks()
        if recheck:
            self._sample(time.monotonic())
            if self._signature != signature:
                get_logger("watchdog").warning(
                    "slow: rank %d waited %.0f s (stall timeout %g s) and then moved on",
                    self.info.rank,
                    report.waited_s,
                    self.stall_timeout_s,
                )
                return
        self._fired = True
        mine = str(self.info.rank)
        if self._store.compare_set("reporter", "", mine).decode() == mine:
            self.on_stall(report)
        else:  # another rank reports: end with it now if its abort is up, not a beat later
            self._serve_requests()

    def silent_s(self, rank: int) -> float | None:
        """Seconds since a new heartbeat of ``rank`` was seen here (``None``: never seen)."""
        heard = self._heard_at.get(rank)
        return None if heard is None else time.monotonic() - heard

    def lost_contact(self) -> str:
        """What this rank last knew of the others, for an error after a collective failed:
        e.g. ``"no heartbeat from rank 0 for 15 s (host-a pid 12); the rendezvous store has
        not answered for 15 s"``."""
        silent_after_s = 2 * self.interval_s + 1
        parts = []
        for rank in range(self.info.world_size):
            age = self.silent_s(rank)
            if rank == self.info.rank or (age is not None and age <= silent_after_s):
                continue
            beat = self._beats.get(rank, {})
            where = f" ({beat['host']} pid {beat['pid']})" if beat else ""
            if age is None:
                parts.append(f"no heartbeat ever seen from rank {rank}")
            else:
                parts.append(f"no heartbeat from rank {rank} for {age:.0f} s{where}")
        store_silent_s = time.monotonic() - self._store_ok_at
        if store_silent_s > silent_after_s and not self._fired:  # (busy reporting, not lost)
            parts.append(f"the rendezvous store has not answered for {store_silent_s:.0f} s")
        return "; ".join(parts) or "; ".join(["every rank's heartbeat is recent", *self._busy()])

    def _busy(self, limit: int = 3) -> list[str]:
        """Where the other ranks outside a collective had stayed for two heartbeats or more at
        their last one: ``"rank 1 was running train.py:40 (in load) for 30 s at its last
        heartbeat"``; past ``limit`` ranks, one clause says how many more."""
        stuck = [
            f"rank {rank} was {describe(position, self.group_labels)} for {still_s:.0f} s at its "
            "last heartbeat"
            for rank, (position, still_s) in sorted(self._fresh_positions().items())
            if position.state == RUNNING and position.site and still_s >= 2 * self.interval_s
        ]
        if len(stuck) > limit:
            stuck = [*stuck[:limit], f"{len(stuck) - limit} more rank(s) likewise"]
        return stuck

    def _gather_stacks(self) -> dict[int, str]:
        # only where no request is up: a peer that found the same deadlock a moment earlier may
        # have set its abort already, and a "dump" over it would hide it from this rank, which
        # then trains on until the reporter's exit makes its collective fail (an echo)
        self._store.compare_set("request", "", "dump")
        self._answered_dump = True
        self._store.set(f"stack/{self.info.rank}", main_thread_stack(self._thread_id))
        keys = [f"stack/{r}" for r in range(self.info.world_size)]
        deadline = time.monotonic() + max(3 * self.interval_s, 2.0)
        while time.monotonic() < deadline and not self._store.check(keys):
            time.sleep(0.05)
        return {
            r: self._store.get(key).decode()
            for r, key in enumerate(keys)
            if self._store.check([key])
        }

    def _report_and_exit(self, report: StallReport) -> None:
        self._ending.set()
        prefix = f"[rank {self.info.rank}/{self.info.world_size}]"
        print(
            "\n".join(f"{prefix} {line}" for line in report.text().splitlines()),
            file=sys.stderr,
            flush=True,
        )
        error = (DeadlockError if report.kind == "deadlock" else StallError)(report.text())
        self._record(error)
        self._store.set("request", f"abort\n{report.headline}")
        self._leave_in_order()
        self._exit(error, recorded=True)

    def _leave_in_order(self) -> None:
        """End together: every rank waits until all have read the abort (so no training thread
        sees a peer vanish first and reports that as a second error); rank 0, which hosts the
        store under ``ddpkit run`` and ``make_store``, leaves last. Each wait is bounded."""
        ranks = range(self.info.world_size)
        self._store.set(f"stopped/{self.info.rank}", "1")
        if self.info.rank == 0:
            self._wait_for([f"leaving/{r}" for r in ranks if r != 0])
        else:
            self._wait_for([f"stopped/{r}" for r in ranks])
            self._store.set(f"leaving/{self.info.rank}", "1")

    def _wait_for(self, keys: list[str]) -> None:
        deadline = time.monotonic() + 3 * self.interval_s
        while time.monotonic() < deadline and not self._store.check(keys):
            time.sleep(0.02)

    def _record(self, error: StallError) -> None:
        if self.recorder is not None:
            self.recorder(error)

    def _exit(self, error: StallError, recorded: bool = False) -> None:
        self._ending.set()
        if not recorded:
            self._record(error)
            prefix = f"[rank {self.info.rank}/{self.info.world_size}]"
            print(f"{prefix} {str(error).splitlines()[0]}", file=sys.stderr, flush=True)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(1)
