"""Watchdog: turn a collective that waits too long into a report that names the late rank.

Each rank runs one background thread. The training thread marks the collectives it enters with
:meth:`Watchdog.watch` (ddpkit's collectives, barriers and the DDP backward do this through
:meth:`ddpkit.Runtime.watch`): a counter and a name, kept in memory, nothing sent. Every
``interval_s`` the thread publishes a heartbeat through the rendezvous store: ``(collective
number, name, inside or not, wall time)``. When this rank has waited inside one collective
longer than ``stall_timeout_s``, its thread

1. reads every rank's heartbeat and sorts them: waiting in the same collective, *not arrived*
   (still before it), in a different collective, or silent (no heartbeat: dead, or blocked
   while holding the GIL);
2. asks every rank for the Python stack of its training thread and waits briefly for them;
3. hands the report to ``on_stall``. The default prints it with a ``[rank r/N]`` prefix,
   records it for ``ddpkit run``'s summary, tells the other ranks to stop (they exit after a
   short grace), and ends the process with exit status 1 -- rather than waiting out the
   collective timeout. The training thread is blocked inside the collective, where Python
   cannot raise, so ending the process is the only way out.

Cost when nothing is wrong: two attribute writes per collective in the training thread, and
one store write plus two key checks per ``interval_s`` in the background thread.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch.distributed as dist

from ddpkit.distributed.env import ProcessInfo
from ddpkit.errors import ConfigError, DistributedError
from ddpkit.log import get_logger

PREFIX = "ddpkit/watchdog"
MAX_STACK_FRAMES = 12


class StallError(DistributedError):
    """A collective waited past the stall timeout (the watchdog's report is the message)."""


@dataclass
class StallReport:
    """What the watchdog found.

    Attributes:
        rank: the rank that detected the stall.
        op: the collective it waits in, and ``seq`` its number (1 = the first watched one).
        waited_s: how long it had waited, in seconds.
        late_ranks: ranks that have not arrived at collective ``seq`` (or are silent).
        peers: one line per other rank saying where it is.
        stacks: rank -> the Python stack of its training thread (missing when it did not answer).
    """

    rank: int
    world_size: int
    op: str
    seq: int
    waited_s: float
    late_ranks: list[int] = field(default_factory=list)
    peers: list[str] = field(default_factory=list)
    stacks: dict[int, str] = field(default_factory=dict)

    @property
    def headline(self) -> str:
        late = ", ".join(map(str, self.late_ranks)) or "none found"
        return (
            f"stall: rank {self.rank} waited {self.waited_s:.0f} s in {self.op} (collective "
            f"#{self.seq}); late rank(s): {late}"
        )

    def text(self) -> str:
        lines = [self.headline, *(f"  {line}" for line in self.peers)]
        for rank in range(self.world_size):
            stack = self.stacks.get(rank)
            lines.append(f"  --- stack of rank {rank}'s training thread:")
            lines += [f"    {line}" for line in (stack or "(no answer)\n").rstrip().splitlines()]
        return "\n".join(lines)


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
    """Per-rank stall detector; see the module docstring.

    Args:
        store: the job's rendezvous store (shared by all ranks).
        info: this process's rank and world size.
        stall_timeout_s: report a collective that waits longer than this, in seconds.
        interval_s: heartbeat period, in seconds; a rank counts as silent after ``2 *
            interval_s + 1`` seconds without a new one.
        on_stall: called (in the watchdog thread) with the :class:`StallReport`; the default
            prints it, records it and ends the process (exit status 1).

    Raises:
        ConfigError: ``interval_s`` not positive, or ``stall_timeout_s`` below two intervals.
    """

    def __init__(
        self,
        store: dist.Store,
        info: ProcessInfo,
        stall_timeout_s: float,
        interval_s: float = 1.0,
        on_stall: Callable[[StallReport], None] | None = None,
    ) -> None:
        if not interval_s > 0 or not stall_timeout_s >= 2 * interval_s:
            raise ConfigError(
                f"invalid watchdog timing: stall_timeout_s={stall_timeout_s!r}, "
                f"interval_s={interval_s!r}. The stall timeout must be at least two heartbeat "
                "intervals, e.g. 300 and 1."
            )
        self.info = info
        self.stall_timeout_s = float(stall_timeout_s)
        self.interval_s = float(interval_s)
        self.on_stall = on_stall or self._report_and_exit
        self._store = dist.PrefixStore(PREFIX, store)
        self._thread_id = threading.get_ident()
        self._seq = 0  # watched collectives entered so far
        self._current: tuple[int, str, float | None] = (0, "", None)  # seq, op, entered (mono)
        self._answered_dump = self._fired = False
        self._checked_seq = 0  # the last collective diagnosed without a late rank
        self._abort_seen_at: float | None = None
        self._beats: dict[int, dict] = {}  # rank -> its latest heartbeat
        self._heard_at: dict[int, float] = {}  # rank -> local monotonic time of its last new beat
        self._store_ok_at = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddpkit-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the background thread (idempotent). Not a collective."""
        self._stop.set()
        if self._thread.is_alive() and threading.get_ident() != self._thread.ident:
            self._thread.join(timeout=self.interval_s + 5)

    @contextmanager
    def watch(self, op: str) -> Iterator[None]:
        """Mark the enclosed code as collective number N named ``op``.

        Every rank must enter the same watched collectives in the same order (as collectives
        require anyway); the numbering is how ranks are compared.
        """
        self._seq += 1
        outer = self._current
        self._current = (self._seq, op, time.monotonic())
        try:
            yield
        finally:
            # Back in an enclosing watched block, its wait starts again now (the inner call
            # was progress); the number stays the newest, so ranks still compare in order.
            restart = time.monotonic() if outer[2] is not None else None
            self._current = (self._seq, outer[1] if restart else op, restart)

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
        seq, op, entered = self._current
        beat = {
            "seq": seq,
            "op": op,
            "inside": entered is not None,
            "time_s": time.time(),
            "pid": os.getpid(),
            "host": socket.gethostname(),
        }
        self._store.set(f"beat/{self.info.rank}", json.dumps(beat))
        self._read_beats()
        self._store_ok_at = time.monotonic()
        if not self._answered_dump and self._store.check(["dump"]):
            self._answered_dump = True
            self._store.set(f"stack/{self.info.rank}", main_thread_stack(self._thread_id))
        if self._store.check(["abort"]) and not self._fired:
            self._follow_abort()
        if entered is not None and not self._fired and seq != self._checked_seq:
            waited = time.monotonic() - entered
            if waited > self.stall_timeout_s:
                self._handle_stall(self._diagnose(seq, op, waited))

    def _handle_stall(self, report: StallReport) -> None:
        """Fail with the report, unless the wait ended while it was being made (a slow
        collective: warned once), or another rank already reports (it tells us to stop).

        With no late rank by position (every rank inside the same block, e.g. one spinning in
        Python inside a watched block) it still fails: the stacks show who is where.
        """
        seq, _, entered = self._current
        if seq != report.seq or entered is None:
            self._checked_seq = report.seq
            get_logger("watchdog").warning(
                "slow collective: %s waited %.0f s (stall timeout %g s) and then finished",
                report.op, report.waited_s, self.stall_timeout_s,
            )  # fmt: skip
            return
        self._fired = True
        mine = str(self.info.rank)
        if self._store.compare_set("reporter", "", mine).decode() == mine:
            self.on_stall(report)

    def _follow_abort(self) -> None:
        """Another rank reported a stall: answer its stack request, then stop after a grace."""
        now = time.monotonic()
        if self._abort_seen_at is None:
            self._abort_seen_at = now
        elif now - self._abort_seen_at >= 2 * self.interval_s:
            headline = self._store.get("abort").decode()
            self._exit(StallError(f"stopped by another rank's watchdog: {headline}"))

    def _read_beats(self) -> None:
        """Fetch every rank's heartbeat (one round trip once all exist); note which are new.

        Ages are measured on this machine's clock, from when a new beat was first seen, so
        clocks that differ between nodes do not matter.
        """
        keys = [f"beat/{r}" for r in range(self.info.world_size)]
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

    def silent_s(self, rank: int) -> float | None:
        """Seconds since a new heartbeat of ``rank`` was seen here (``None``: never seen)."""
        heard = self._heard_at.get(rank)
        return None if heard is None else time.monotonic() - heard

    def lost_contact(self) -> str:
        """What this rank last knew of the others, for an error after a collective timed out:
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
        return "; ".join(parts) or "every rank's heartbeat is recent"

    def _diagnose(self, seq: int, op: str, waited_s: float) -> StallReport:
        report = StallReport(self.info.rank, self.info.world_size, op, seq, waited_s)
        silent_after_s = 2 * self.interval_s + 1
        for rank in range(self.info.world_size):
            if rank == self.info.rank:
                continue
            where, late = describe_peer(
                self._beats.get(rank), self.silent_s(rank), seq, op, silent_after_s
            )
            report.peers.append(f"rank {rank}: {where}")
            if late:
                report.late_ranks.append(rank)
        report.stacks = self._gather_stacks()
        return report

    def _gather_stacks(self) -> dict[int, str]:
        self._store.set("dump", str(self.info.rank))
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
        prefix = f"[rank {self.info.rank}/{self.info.world_size}]"
        print("\n".join(f"{prefix} {line}" for line in report.text().splitlines()),
              file=sys.stderr, flush=True)  # fmt: skip
        error = StallError(report.text())
        self._record(error)
        self._store.set("abort", report.headline)
        time.sleep(3 * self.interval_s)  # let the others read the abort before the store goes
        self._exit(error, recorded=True)

    def _record(self, error: StallError) -> None:
        from ddpkit.launch.failures import RUN_DIR_ENV, make_record, write_record

        if os.environ.get(RUN_DIR_ENV):
            write_record(make_record(error), os.environ[RUN_DIR_ENV])

    def _exit(self, error: StallError, recorded: bool = False) -> None:
        if not recorded:
            self._record(error)
            prefix = f"[rank {self.info.rank}/{self.info.world_size}]"
            print(f"{prefix} {str(error).splitlines()[0]}", file=sys.stderr, flush=True)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(1)


def describe_peer(
    beat: dict | None, silent_s: float | None, seq: int, op: str, silent_after_s: float
) -> tuple[str, bool]:
    """Where a peer is relative to collective ``seq`` named ``op``: ``(text, is_late)``.

    ``silent_s``: seconds since this rank last saw a new heartbeat from the peer.
    """
    if beat is None or silent_s is None:
        return "no heartbeat yet (not started, or started without the watchdog)", True
    place = f"collective #{beat['seq']} ({beat['op'] or 'none'})"
    if silent_s > silent_after_s:
        return (
            f"silent for {silent_s:.0f} s ({beat['host']} pid {beat['pid']}), last at {place}: "
            "dead, unreachable, or blocked while holding the GIL",
            True,
        )
    if beat["seq"] < seq or (beat["seq"] == seq and not beat["inside"] and beat["op"] != op):
        state = "inside" if beat["inside"] else "after"
        return f"has not arrived: {state} {place}, running other code (see its stack)", True
    if beat["seq"] > seq:
        return f"is ahead, at {place}: the ranks called different collectives", True
    if beat["op"] != op:
        return f"is in a different collective: {place}", True
    if not beat["inside"]:
        return f"has passed {place} and runs other code", False
    return f"waiting in {place} too", False
