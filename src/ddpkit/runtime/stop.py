"""Stop on a signal at a step every rank agrees on: the handlers, the agreement, the exception.

A cluster stops a job with a signal: SIGTERM (Kubernetes, Slurm's preemption, torchrun passing
its own on), SIGUSR1 ahead of a time limit (Slurm's ``--signal``), SIGINT (Ctrl-C). It may reach
one rank, some, or all of them, at any moment. Acting on it where it lands (raising in the
middle of a backward, or dying) leaves the other ranks waiting in a collective, or loses every
step since the last checkpoint. Here a signal only records a request; the ranks then agree, at
a step boundary, with one small all-reduce (MAX) of each rank's request on the training group,
so every rank stops after the same step. :class:`ddpkit.CheckpointManager` saves at that step and
raises :class:`TrainingStopped`, which ends the process like the signal would have, after the
save.

Cost: the check is a blocking all-reduce of two int64 values, run every K calls. Rank 0 measures
the check's time and the time between calls, and puts the next K into the check itself (so every
rank has it), chosen so the checks cost at most ``CHECK_BUDGET`` (1 %) of the training time,
with no more than ``MAX_CHECK_GAP_S`` (1 s) of training and ``MAX_CHECK_CALLS`` (20) calls
between two checks. A peer that died
fails the all-reduce at once (gloo's closed connection), as DDP's next all-reduce would have;
the watchdog names a peer that hangs.

A second signal (another stop signal, or the same one more than ``DUPLICATE_WINDOW_S`` after
the first) means "stop now": the handler raises :class:`TrainingStopped` (``now=True``) wherever
the program is, e.g. abandoning a checkpoint write (the writes are atomic: the newest complete
checkpoint stands). The same signal again within the window is the same request delivered
twice: a signal sent to the whole process group reaches each rank, and torchrun passes its own
copy on a few milliseconds later.

Until the program asks (the first :meth:`StopRequest.poll`, e.g. the first
``CheckpointManager.maybe_save``), a signal has its usual effect (the process ends; Ctrl-C
raises ``KeyboardInterrupt``); so does a request no step boundary answers within the grace
period (a loop that stopped asking): ddpkit never turns a signal into one that is ignored.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ddpkit.runtime.signals import (  # torch-free: the launcher's flags read them
    DEFAULT_STOP_SIGNALS,
    GRACE_PERIOD_ENV,
    STOP_SIGNALS_ENV,
    TORCHRUN_DEFAULT_GRACE_S,
    parse_stop_signals,
)

if TYPE_CHECKING:
    from ddpkit.runtime.process_group import Runtime

TORCHRUN_SHUTDOWN_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"  # torchrun's own setting
DUPLICATE_WINDOW_S = 1.0
CHECK_BUDGET = 0.01
MAX_CHECK_GAP_S = 1.0
MAX_CHECK_CALLS = 20


def default_stop_signals(environ: dict[str, str] | None = None) -> tuple[signal.Signals, ...]:
    """The launcher's ``--stop-signals`` (``DDPKIT_STOP_SIGNALS``), else SIGTERM, SIGINT,
    SIGUSR1."""
    env = os.environ if environ is None else environ
    if STOP_SIGNALS_ENV in env:
        return parse_stop_signals(env[STOP_SIGNALS_ENV])
    return DEFAULT_STOP_SIGNALS


def grace_period_s(environ: dict[str, str] | None = None) -> float | None:
    """Seconds the launcher waits after passing a stop signal on, before SIGKILL.

    ddpkit's launcher says so (``DDPKIT_GRACE_PERIOD_S``); under plain torchrun it is
    ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` or torchrun's default, 30 s; a process no launcher
    started has none (``None``).
    """
    env = os.environ if environ is None else environ
    for name in (GRACE_PERIOD_ENV, TORCHRUN_SHUTDOWN_ENV):
        try:
            return float(env[name])
        except (KeyError, ValueError):
            continue
    return float(TORCHRUN_DEFAULT_GRACE_S) if "TORCHELASTIC_RUN_ID" in env else None


class TrainingStopped(SystemExit):
    """Every rank stopped at the step they agreed on, after a stop signal.

    Raised by :meth:`ddpkit.CheckpointManager.maybe_save` after it saved that step (on every
    rank, at the same step), or by the signal handler itself for a second signal ("stop now").
    A ``SystemExit``: uncaught, the process ends with status 128 + the signal number (SIGTERM:
    143, SIGUSR1: 138, Ctrl-C: 130) and no traceback, as the signal would have ended it. Under
    ``ddpkit run`` the rank exits 0 instead and the launcher reports the stop (and exits with
    that status).

    Attributes:
        signal: the signal the ranks agreed on (the largest number among those received).
        step: the step every rank finished before stopping (``None`` for a stop now).
        checkpoint: the newest complete checkpoint folder when it stopped, or ``None``.
        saved: ``checkpoint`` was written at ``step`` by this stop (``False``: nothing had
            been trained since it, or there is none).
        now: a second signal stopped the process where it was.
        here: this process received a stop signal itself (``False``: the request came from
            other ranks through the agreement).
        note: where in the program, set by whoever knows (``ddpkit train``: ``"(epoch 2/5)"``).
    """

    code: int  # SystemExit's exit status, always 128 + the signal number here

    def __init__(
        self,
        signum: int,
        *,
        step: int | None = None,
        checkpoint: Path | None = None,
        saved: bool = False,
        now: bool = False,
        here: bool = True,
    ) -> None:
        super().__init__(128 + int(signum))
        self.signal = signal.Signals(signum)
        self.step = step
        self.checkpoint = checkpoint
        self.saved = saved
        self.now = now
        self.here = here
        self.note = ""
        self.recorded = False  # the stop record for ddpkit's launcher is written

    def __str__(self) -> str:
        if self.now:
            kept = "" if self.checkpoint is None else f"; newest checkpoint {self.checkpoint}"
            return f"stopped now by a second {self.signal.name}{kept}"
        where = f"after step {self.step}" if self.step is not None else "before training"
        where += f" {self.note}" if self.note else ""
        if self.saved:
            kept = f"saved checkpoint {self.checkpoint}"
        elif self.checkpoint is not None:
            kept = f"nothing trained since checkpoint {self.checkpoint}"
        else:
            kept = "no checkpoint"
        return f"stopped by {self.signal.name} {where}; {kept}"


# The StopRequest that last reached an agreement in this process (one slot), for ddpkit run's
# worker, which outlives the runtime's with block: what it needs is derived from the request.
_LAST_AGREEMENT: list[StopRequest] = []


def stop_agreed_elsewhere() -> signal.Signals | None:
    """The signal of the stop this process agreed to at the request of other ranks (no stop
    signal reached this process), or ``None``: no stop, a stop this process was signalled for,
    or one cleared with :meth:`StopRequest.clear`.

    ``ddpkit run``'s worker reads it when a script returns normally after breaking out of its
    loop on ``rt.stop_requested()``: under an elastic job it then exits 128 + the signal, as
    after a :class:`TrainingStopped` raised on another node's request. Not a collective.
    """
    request = _LAST_AGREEMENT[-1] if _LAST_AGREEMENT else None
    if request is None or request.agreed is None or request.agreed_here:
        return None
    return request.agreed


class StopRequest:
    """The stop signals of one process, and the ranks' agreement on when to stop.

    Built and installed by :func:`ddpkit.init_runtime`; :meth:`ddpkit.Runtime.stop_requested`
    calls :meth:`poll`.

    Args:
        signals: the signals that request a stop (see :func:`default_stop_signals`).
        fallback_s: a request still unanswered after this many seconds (no step boundary asked)
            takes the signal's usual effect; ``None``: the grace period, or 30 s.

    Attributes:
        received: the first stop signal this process received, or ``None``.
        agreed: the signal every rank agreed to stop on, or ``None``.
        armed: the program asks (:meth:`poll` was called): signals now wait for the agreement.
    """

    def __init__(
        self, signals: Iterable[int] = DEFAULT_STOP_SIGNALS, *, fallback_s: float | None = None
    ) -> None:
        self.signals = parse_stop_signals(",".join(str(int(s)) for s in signals))
        self.fallback_s = fallback_s or grace_period_s() or TORCHRUN_DEFAULT_GRACE_S
        self.received: signal.Signals | None = None
        self.newest_checkpoint: Path | None = None  # a CheckpointManager sets it (stop now)
        self.received_at = 0.0
        self.agreed: signal.Signals | None = None
        self.armed = False
        self._previous: dict[signal.Signals, Any] = {}
        self._timer: threading.Timer | None = None
        self._calls = 0
        self._next_check = 1
        self._mark: tuple[float, int] | None = None  # (time, calls) at the end of the last check
        self._check_s = 0.0
        self._closed = False

    def install(self) -> bool:
        """Install the handlers (main thread only; elsewhere nothing changes). Returns whether
        they were installed. Signals blocked by ddpkit's launcher stay pending until armed."""
        if not self.signals or threading.current_thread() is not threading.main_thread():
            return False
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return True

    def arm(self) -> None:
        """From now on a signal waits for the agreement; unblocks the signals ddpkit's launcher
        kept pending while this process started."""
        if self.armed or not self._previous:
            return
        self.armed = True
        signal.pthread_sigmask(signal.SIG_UNBLOCK, self.signals)  # pending ones arrive here

    def restore(self) -> None:
        """Put back the handlers that were there before :meth:`install` (idempotent).

        After a stop request the handler stays until the process ends, but only to swallow a
        repeat of the first signal within ``DUPLICATE_WINDOW_S`` (torchrun's copy may come after
        the rank has already stopped); any other signal then has its usual effect.
        """
        self._cancel_timer()
        if self.received is not None:
            self._closed = True
            return
        previous, self._previous = self._previous, {}
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    def clear(self) -> None:
        """Forget the request and the agreement (to train on in this process after handling a
        :class:`TrainingStopped`). Call on every rank, at the same point."""
        self._cancel_timer()
        self.received = self.agreed = None
        self._closed = False

    def _handle(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        duplicate = signum == self.received and now - self.received_at < DUPLICATE_WINDOW_S
        if self._closed:  # the runtime closed after a stop: the process is ending
            if not duplicate:
                self._usual_effect(signum, frame)
            return
        if self.received is None:
            if not self.armed:  # nobody asks yet: the signal's usual effect
                self._usual_effect(signum, frame)
                return
            self.received, self.received_at = signal.Signals(signum), now
            self._timer = threading.Timer(self.fallback_s, self._unanswered, args=(signum,))
            self._timer.daemon = True
            self._timer.start()
            return
        if duplicate:
            return  # the same request delivered twice (to the group, and passed on by torchrun)
        self._closed = True  # a third signal has its usual effect
        raise TrainingStopped(signum, now=True, checkpoint=self.newest_checkpoint)

    def _usual_effect(self, signum: int, frame: Any) -> None:
        previous = self._previous.get(signal.Signals(signum), signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)  # Python's Ctrl-C handler raises KeyboardInterrupt
        elif previous != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)  # the process ends as it would have without ddpkit

    def _unanswered(self, signum: int) -> None:
        """Timer thread: no step boundary answered the request; the signal's usual effect."""
        if self.agreed is not None:
            return
        from ddpkit.log import get_logger

        get_logger("stop").warning(
            "%s: no step boundary asked for the stop within %g s (the loop does not call "
            "stop_requested() or maybe_save()); ending as the signal would",
            signal.Signals(signum).name,
            self.fallback_s,
        )
        self.armed, self.received = False, None
        if callable(self._previous.get(signal.Signals(signum))):
            os.kill(os.getpid(), signum)  # e.g. Ctrl-C's KeyboardInterrupt, in the main thread
            return
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(128 + signum)  # the main thread may be blocked in C: end from here

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def poll(self, runtime: Runtime) -> bool:
        """Whether every rank agreed to stop; see :meth:`ddpkit.Runtime.stop_requested`.

        Collective: call on every rank the same number of times (it communicates every K calls,
        with K carried in the check itself).
        """
        self.arm()
        if self.agreed is not None:
            return True
        self._calls += 1
        if runtime.process_group is None:
            if self.received is not None:
                self._agree(self.received)
            return self.agreed is not None
        if self._calls < self._next_check:
            return False
        start = time.perf_counter()
        proposal = self._next_interval(start) if runtime.rank == 0 else 0
        row = torch.tensor([int(self.received or 0), proposal], dtype=torch.int64)
        work = row.to(runtime.device)  # nccl reduces device tensors; gloo CPU ones
        with runtime.watch("stop check"):
            dist.all_reduce(work, op=dist.ReduceOp.MAX, group=runtime.process_group)
        signum, interval = (int(v) for v in work.cpu().tolist())
        end = time.perf_counter()
        self._check_s, self._mark = end - start, (end, self._calls)
        self._next_check = self._calls + max(1, interval)
        if signum:
            self._agree(signum)
        return self.agreed is not None

    def poll_live(self, membership: Any) -> bool:
        """:meth:`poll` in a live fault-tolerant job: no collective; the members agreed in
        their last vote (:meth:`ddpkit.live.membership.LiveMembership.stop_requested`): the
        launcher's stop signal stops every member, a signal of this process's own makes it
        leave (its peers go on without it)."""
        self.arm()
        if self.agreed is None and membership.stop_requested():
            name = membership.stop_signal if membership.stop_signal.startswith("SIG") else ""
            self._agree(signal.Signals[name] if name else (self.received or signal.SIGTERM))
        return self.agreed is not None

    def received_name(self) -> str:
        """The name of the stop signal this process received (``""``: none)."""
        return self.received.name if self.received is not None else ""

    def _next_interval(self, start: float) -> int:
        """Rank 0's K: checks at most ``CHECK_BUDGET`` of the time, at most ``MAX_CHECK_GAP_S``
        and ``MAX_CHECK_CALLS`` apart (from the last check's time and the mean time between
        calls since)."""
        if self._mark is None:
            return 1
        mark_time, mark_calls = self._mark
        per_call_s = max((start - mark_time) / max(self._calls - mark_calls, 1), 1e-9)
        wanted = math.ceil(self._check_s / (CHECK_BUDGET * per_call_s))
        return max(1, min(wanted, int(MAX_CHECK_GAP_S / per_call_s), MAX_CHECK_CALLS))

    @property
    def agreed_here(self) -> bool:
        """The ranks agreed to stop and this process received a stop signal itself (``False``:
        the request came from other ranks through the agreement)."""
        return self.agreed is not None and self.received is not None

    def _agree(self, signum: int) -> None:
        self.agreed = signal.Signals(signum)
        _LAST_AGREEMENT[:] = [self]
        self._cancel_timer()
