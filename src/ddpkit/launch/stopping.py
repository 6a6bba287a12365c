"""How ``ddpkit run`` stops a job on a signal, and the one line that says where it stopped.

torchrun does the passing on: with ``--signals-to-handle`` it catches the stop signals too
(SIGUSR1 is not in its default set), sends the same signal to every worker and SIGKILLs those
still alive after ``--shutdown-timeout`` seconds: ddpkit's ``--grace-period`` (default 30 s,
torchrun's own default). The workers (:mod:`ddpkit.runtime.stop`) agree on a step, save it
and exit 0, each leaving a stop record; this module reads the records and prints one line: the
signal, the step, the checkpoint and the command that resumes. A second signal to the launcher
interrupts torchrun's wait: torchrun then sends SIGTERM, which the workers take as "stop now".

While torchrun starts the workers the stop signals are blocked in the launcher's main thread,
so every worker starts with them blocked (a signal mask survives fork and exec): a signal that
reaches a rank while it imports torch or joins the rendezvous stays pending until the rank's
runtime waits for it, instead of ending the rank. The launcher itself still receives them: a
helper thread keeps them unblocked, and Python runs the handler in the main thread.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ddpkit.diagnostics.failures import (
    FailureRecord,
    StopRecord,
    count_done_records,
    newest_checkpoint,
    newest_done_time,
    read_records,
    read_stop_records,
)

if TYPE_CHECKING:
    from ddpkit.launch.launcher import LaunchSpec

TORCHRUN_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # its --signals-to-handle default


def signals_to_handle(stop_signals: tuple[signal.Signals, ...]) -> str:
    """torchrun's ``--signals-to-handle``: its default set plus the stop signals."""
    names = list(TORCHRUN_SIGNALS) + [s.name for s in stop_signals]
    return ",".join(dict.fromkeys(names))


@contextlib.contextmanager
def blocked_while_workers_start(stop_signals: tuple[signal.Signals, ...]) -> Iterator[None]:
    """Block ``stop_signals`` in this thread (workers started inside inherit them blocked);
    afterwards unblock them and put back the handlers torchrun replaced."""
    if not stop_signals or threading.current_thread() is not threading.main_thread():
        yield
        return
    names = set(TORCHRUN_SIGNALS) | {s.name for s in stop_signals}
    handlers = {sig: signal.getsignal(sig) for sig in map(signal.Signals.__getitem__, names)}
    done = threading.Event()
    receiver = threading.Thread(target=done.wait, name="ddpkit-signal-receiver", daemon=True)
    receiver.start()  # created before the block: the launcher still receives the signals
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        done.set()
        for sig, handler in handlers.items():  # torchrun leaves its own handlers installed
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


@contextlib.contextmanager
def raising_on_signals(names: str) -> Iterator[None]:
    """Within the block, each signal of ``names`` (``"SIGTERM,SIGHUP"``) whose action is still
    the default one (ending the process at once) raises torch's ``SignalException`` instead,
    as torchrun's own handler does once its workers run: a signal that reaches the launcher
    before then (during its checks or the rendezvous) still runs its ``finally`` blocks, which
    remove the job's temporary folders. Signals with a handler (Ctrl-C's ``KeyboardInterrupt``)
    or ignored stay so. Main thread only; elsewhere nothing changes."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def _raise(signum: int, frame: object) -> None:
        sig = signal.Signals(signum)
        raise SignalException(f"launcher got signal {sig.name}", sigval=sig)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = [signal.Signals[name] for name in names.split(",")]
    default = [sig for sig in sigs if signal.getsignal(sig) == signal.SIG_DFL]
    for sig in default:
        signal.signal(sig, _raise)
    try:
        yield
    finally:
        for sig in default:
            signal.signal(sig, signal.SIG_DFL)


def _where(
    records: list[StopRecord], failures: list[FailureRecord], spec: LaunchSpec
) -> tuple[str, bool]:
    """``(" after step 250 (epoch 2/5)", clean)``: ``clean`` when every rank of this node
    stopped at that step by itself (no stop now, none killed at the end of the grace period,
    none failed). A failure after a rank stopped at once is that stop's doing: a peer inside a
    collective with it fails ("a peer's process ended") before its own handler can run."""
    missing = sorted(set(range(spec.nproc)) - {r.rank % spec.nproc for r in records})
    stopped_now_s = min((r.time_s for r in records if r.now), default=None)
    if stopped_now_s is not None:
        failures = [f for f in failures if f.time_s < stopped_now_s]
    if failures and missing:  # e.g. a peer killed during the stop's save: say who failed
        return (
            ", but the job failed before every rank stopped at a step (first failure: "
            f"{failures[0].headline})",
            False,
        )
    if not records:
        return " before the ranks agreed on a step (their runtime was not waiting for it)", False
    first = records[0]
    if any(r.now for r in records):
        return f" at once (a second {next(r.signal for r in records if r.now)})", False
    where = f" after step {first.step}{f' {first.note}' if first.note else ''}"
    if missing:
        ranks = ", ".join(map(str, missing))
        return (
            f"{where}, but local rank(s) {ranks} did not stop within the grace period "
            f"({spec.grace_period_s} s) and were killed (SIGKILL)",
            False,
        )
    return where, True


def _failures(run_dir: str, records: list[StopRecord]) -> list[FailureRecord]:
    """The failure records of the attempt that stopped (none of an earlier, restarted one);
    Ctrl-C's ``KeyboardInterrupt`` in a rank that never asked for the stop is the stop itself."""
    failures = [f for f in read_records(run_dir) if f.type != "KeyboardInterrupt"]
    newest = max([r.restart for r in records] + [f.restart for f in failures], default=0)
    return [f for f in failures if f.restart == newest]


def stop_label(sig: signal.Signals) -> str:
    """How a stop line names its signal: ``interrupted (Ctrl-C)`` or ``stopped by SIGTERM``."""
    return "interrupted (Ctrl-C)" if sig == signal.SIGINT else f"stopped by {sig.name}"


def kept_checkpoint(folder: str | Path, *, saved: bool) -> str:
    """The stop line's checkpoint part: ``; saved: checkpoint step-N in DIR`` when the stop wrote
    it, else ``; the newest complete checkpoint is step-N in DIR``."""
    label = "saved: checkpoint" if saved else "the newest complete checkpoint is"
    return f"; {label} {Path(folder).name} in {Path(folder).parent}"


def _kept(records: list[StopRecord], spec: LaunchSpec, clean: bool, run_dir: str) -> str:
    """The end of the line: the checkpoint and the command that resumes (the newest one the
    job's ``CheckpointManager`` told the launcher of, when no rank lived to record one)."""
    if spec.on_interrupt is not None:
        return spec.on_interrupt(saved=clean)
    newest = next((r.checkpoint for r in records if r.checkpoint), None) or newest_checkpoint(
        run_dir
    )
    if newest is None:
        return f"; no checkpoint was saved{resume_part(spec)}"
    return f"{kept_checkpoint(newest, saved=clean)}{resume_part(spec)}"


def resume_part(spec: LaunchSpec) -> str:
    """``"; resume with: COMMAND"`` for a job whose command is known, else ``""``."""
    return f"; resume with: {spec.resume_command}" if spec.resume_command else ""


def stop_line(spec: LaunchSpec, run_dir: str, received: signal.Signals | None) -> tuple[str, int]:
    """The launcher's last line after a stop signal, and its exit status (128 + the signal).

    A signal that arrived after the ranks' last stop check finds the job completing: the line
    says so and the status is 0.

    Args:
        spec: the launch.
        run_dir: the run folder the workers wrote their stop records to.
        received: the signal the launcher itself received, or ``None`` (it reached only the
            workers: they stopped, torchrun saw every worker exit 0).
    """
    records = read_stop_records(run_dir)
    sig = received or signal.Signals[records[0].signal]
    if not records and count_done_records(run_dir) >= spec.nproc:
        return (
            f"{spec.command}: {sig.name} arrived as the job was finishing: it completed (all "
            f"{spec.world_size} processes ran to their end).",
            0,
        )
    where, clean = _where(records, _failures(run_dir, records), spec)
    line = (
        f"{spec.command}: {stop_label(sig)}{where}; all {spec.world_size} processes stopped"
        f"{_kept(records, spec, clean, run_dir)}"
    )
    return line, 128 + int(sig)


def stopped_by_workers(run_dir: str) -> bool:
    """Whether the job's last workers stopped on a signal (torchrun returned normally after a
    stop), rather than ran to their end.

    Stop records of earlier workers do not count when later ones completed: torchrun's agent
    stops the workers with SIGTERM to restart them when a node joins an elastic job (the
    restart count stays the same), they save at an agreed step as for any stop signal, and the
    restarted workers go on to the end.
    """
    records = read_stop_records(run_dir)
    return bool(records) and max(r.time_s for r in records) > newest_done_time(run_dir)
