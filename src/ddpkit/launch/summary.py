"""The closing lines of a failed ``ddpkit run``: the first failure, what it means, how it ended.

Sources: the failure records the workers wrote (:mod:`ddpkit.diagnostics.failures`), torchrun's exit
codes, and for a rank that died from a signal the last bytes of its stderr
(:mod:`ddpkit.launch.stderr_tail`): gloo's own message and ``faulthandler``'s stacks. A gloo
abort with "Is there a distributed collective mismatch" is reported as that, naming each rank's
operation, call site and sizes, not as a crash without a cause or as a lost network. The advice
to restart (``--max-restarts``) is given only where a restart can help.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ddpkit.diagnostics.failures import FailureRecord
from ddpkit.diagnostics.peers import LOST_PEER, PEER_ENDED, TOLD_ENDED, mentions
from ddpkit.launch.oom import OOM_EVIDENCE
from ddpkit.watchdog.position import short_path

if TYPE_CHECKING:
    from ddpkit.launch.launcher import LaunchSpec

WATCHDOG_TYPES = ("StallError", "DeadlockError")
NATIVE_CRASHES = ("SIGABRT", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGTRAP")
_GLOO_MISMATCH = re.compile(
    r"op\.preamble\.length <= op\.nbytes\. (\d+) vs (\d+)\. Received data size doesn't match"
)
_LOST_PEER = (*LOST_PEER, "Timed out")  # and ddpkit's own "timed out" lines
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_LIBRARY = ("/torch/", "/ddpkit/", "<frozen", "/threading.py", "/runpy.py")


@dataclass(frozen=True)
class NativeCrash:
    """What a rank's stderr tail says about its death.

    Attributes:
        received, expected: gloo's byte counts when it aborted on a collective mismatch, else 0.
        op: the torch.distributed function its training thread was in (``faulthandler``), or
            ``""``; ``site``: the first ``file:line`` outside torch and ddpkit below it.
    """

    received: int = 0
    expected: int = 0
    op: str = ""
    site: str = ""

    @property
    def mismatch(self) -> bool:
        return self.received > 0

    @property
    def where(self) -> str:
        return f"in {self.op} called at {self.site}" if self.op else ""


def read_native_crash(tail: str) -> NativeCrash:
    """Parse gloo's mismatch message and ``faulthandler``'s dump from a stderr tail."""
    found = _GLOO_MISMATCH.search(tail)
    received, expected = (int(found.group(1)), int(found.group(2))) if found else (0, 0)
    op = site = ""
    for block in tail.split("\n\n"):  # faulthandler: one block of frames per thread
        frames = [m for m in map(_FRAME.match, block.splitlines()) if m]
        inner = next((f for f in frames if f["file"].endswith("distributed_c10d.py")), None)
        if inner is None:
            continue
        op = inner["func"]
        outer = frames[frames.index(inner) + 1 :]
        user = next((f for f in outer if not any(s in f["file"] for s in _LIBRARY)), None)
        site = f"{short_path(user['file'])}:{user['line']}" if user else "?"
        break
    return NativeCrash(received, expected, op, site)


def _traceback_tail(text: str, num_lines: int = 3) -> list[str]:
    """The last frame lines of a traceback, without the exception line and caret markers."""
    lines = [line.strip() for line in text.rstrip().splitlines()[:-1]]
    lines = [line for line in lines if line and set(line) - set("^~ ")]
    return lines[-num_lines:] if lines and lines[0].startswith("Traceback") else []


def _report_lines(record: FailureRecord) -> list[str]:
    """A watchdog report's per-rank lines and advice (its stacks were printed above)."""
    lines = record.message.splitlines()[1:]
    end = next((i for i, line in enumerate(lines) if line.strip().startswith("---")), len(lines))
    return [line.strip() for line in lines[:end]]


def _restart_can_help(crashes: dict[int, NativeCrash], records: list[FailureRecord]) -> bool:
    """A killed process, a lost peer or a timeout may not recur; a code error will."""
    if any(not crash.mismatch for crash in crashes.values()):
        return True  # SIGKILL (out of memory, preempted), a segfault on one node ...
    if crashes or not records:
        return False
    first = records[0]
    if first.type == "DeadlockError":
        return False
    return first.type == "StallError" or mentions(first.message, _LOST_PEER)


def summarize_failure(
    records: list[FailureRecord],
    exit_codes: dict[int, int],
    spec: LaunchSpec,
    tails: dict[int, str] | None = None,
    *,
    finished: set[int] | frozenset[int] = frozenset(),
    kill_hints: dict[int, str] | None = None,
    kept: str = "",
) -> list[str]:
    """The closing lines of a failed job: the first failure, then how the job ended.

    Args:
        records: failure records of the final attempt, oldest first.
        exit_codes: rank -> exit status as torchrun reported it (negative: killed by a signal).
        spec: the launch.
        tails: rank -> the last bytes of its stderr (see :mod:`ddpkit.launch.stderr_tail`).
        finished: the ranks of that attempt that ran their script to its end (exit 0).
        kill_hints: rank -> what its SIGKILL was (the out-of-memory killer or not, its memory,
            the fix: :mod:`ddpkit.launch.oom`), said under its line when it is a cause.
        kept: the end of the last line: the newest checkpoint and the command that resumes
            (``"; the newest complete checkpoint is step-N in DIR; resume with: ..."``).
    """
    lines = []
    label = f"{spec.command}:"
    recorded = {r.rank for r in records}
    unrecorded = {rank: code for rank, code in exit_codes.items() if rank not in recorded}
    signals = {rank: signal.Signals(-code).name for rank, code in unrecorded.items() if code < 0}
    # SIGTERM is how torchrun stops the survivors (SIGKILL when they do not stop); count it as
    # a cause only if nothing else is. After a watchdog report or a rank's native crash
    # (SIGABRT, SIGSEGV, ...), a SIGKILL is that stop too (a survivor stuck in a collective),
    # unless the kernel says its out-of-memory killer sent it.
    watchdog = any(r.type in WATCHDOG_TYPES for r in records)
    native = any(name in NATIVE_CRASHES for name in signals.values())
    stopping = {"SIGTERM", "SIGKILL"} if watchdog or native else {"SIGTERM"}
    hints = kill_hints or {}
    crashed = {
        rank: name
        for rank, name in signals.items()
        if name not in stopping or hints.get(rank, "").startswith(OOM_EVIDENCE)
    }
    if not crashed and not records:
        crashed = signals
    crashes = {rank: read_native_crash((tails or {}).get(rank, "")) for rank in crashed}
    for rank, name in sorted(crashed.items()):
        lines += _crash_lines(rank, name, crashes[rank], label, spec.nproc, hints)
    mismatch = any(crash.mismatch for crash in crashes.values())
    if records:
        lines += _first_record_lines(records[0], label, bool(crashed), mismatch, finished)
    if mismatch:
        lines.append(f"{label} hint: {_mismatch_hint(crashes, records)}")
    exited = {rank: code for rank, code in unrecorded.items() if code > 0}
    if exited:
        ranks = ", ".join(f"rank {r} exit status {c}" for r, c in sorted(exited.items()))
        lines.append(f"{label} also failed without a Python exception: {ranks}.")
    if spec.max_restarts:
        restarts = f"gave up after {spec.max_restarts} restart(s)"
    elif _restart_can_help(crashes, records):
        restarts = (
            "restarts are off (--max-restarts 0); add --max-restarts N to restart the workers"
        )
    else:
        restarts = "restarts are off (--max-restarts 0); a restart would fail the same way"
    lines.append(f"{label} job FAILED; all {spec.nproc} processes stopped; {restarts}{kept}.")
    return lines


def _crash_lines(
    rank: int, name: str, crash: NativeCrash, label: str, nproc: int, kill_hints: dict[int, str]
) -> list[str]:
    """The line of a rank that died from signal ``name``, and for SIGKILL what sent it."""
    where = f", {crash.where}" if crash.where else ""
    if crash.mismatch:
        return [
            f"{label} first failure: rank {rank}/{nproc} aborted ({name}): gloo found a "
            f"collective mismatch: it received {crash.received} bytes where it expected "
            f"{crash.expected}{where}."
        ]
    lines = [
        f"{label} first failure: rank {rank}/{nproc} died from signal {name} without a Python "
        f"exception{where}."
    ]
    if name == "SIGKILL" and kill_hints.get(rank):
        lines.append(f"{label} hint: {kill_hints[rank]}")
    return lines


def _first_record_lines(
    first: FailureRecord,
    label: str,
    crashed: bool,
    mismatch: bool,
    finished: set[int] | frozenset[int],
) -> list[str]:
    """The first failure record's headline, where it was, and the hint."""
    lines = [f"{label} {'then' if crashed else 'first failure'}: {first.headline}"]
    if first.type in WATCHDOG_TYPES:
        lines += [f"{label}   {line}" for line in _report_lines(first)]
    else:
        lines += [f"{label}   {line}" for line in _traceback_tail(first.traceback)]
    ended = _peer_that_finished(first, finished)
    if ended is not None:
        lines.append(f"{label} hint: {ended}")
    elif first.hint and not mismatch:
        lines.append(f"{label} hint: {first.hint}")
    return lines


def _peer_that_finished(first: FailureRecord, finished: set[int] | frozenset[int]) -> str | None:
    """The hint when the first failure is a peer's process ending and a peer ran to its end:
    no peer failed, the ranks made different numbers of collective calls."""
    if not finished or not mentions(first.message, (TOLD_ENDED, *PEER_ENDED)):
        return None
    ranks = ", ".join(map(str, sorted(finished)))
    where = first.collective or "a collective"
    return (
        f"rank {ranks} ran its script to the end (exit status 0) while rank {first.rank} was "
        f"still in {where}: the ranks made different numbers of collective calls. Usual causes: "
        "ranks with different numbers of batches (a DataLoader without DistributedSampler, or "
        "without drop_last; ddpkit.build_train_loader gives every rank the same number), or a "
        "collective only some ranks call (inside `if rank == 0:`; evaluate and save on every "
        "rank, or keep collectives out of rank-0-only code)."
    )


def _mismatch_hint(crashes: dict[int, NativeCrash], records: list[FailureRecord]) -> str:
    where = [
        f"rank {rank} {crash.op or '?'} at {crash.site or '?'} (expected {crash.expected} "
        f"bytes, received {crash.received})"
        for rank, crash in sorted(crashes.items())
        if crash.mismatch
    ]
    where += [f"rank {r.rank} {r.collective}" for r in records if r.collective]
    return (
        f"the ranks' collectives do not match: {'; '.join(where)}. Every rank must call the same "
        "collectives in the same order, with tensors of the same shape and dtype; "
        "DDPKIT_DEBUG_COLLECTIVES=1 compares them before each of ddpkit's collectives."
    )
