"""Worker bootstrap that ``ddpkit run`` starts in every rank: run the target, record, shut down.

    python -m ddpkit.launch.worker script.py [args...]
    python -m ddpkit.launch.worker -m package.module [args...]

It runs the target as ``__main__`` (as ``python script.py`` would), and:

- after a stop signal (:class:`ddpkit.TrainingStopped`): writes a stop record for the launcher
  and exits 0 (the launcher says where it stopped and exits 128 + the signal number), so
  torchrun neither restarts the workers nor reports a failure;
- when an exception escapes: writes a :class:`~ddpkit.diagnostics.failures.FailureRecord` (when
  ``DDPKIT_RUN_DIR`` is set), prints the traceback with a ``[rank r/N]`` prefix, exits 1
  (``KeyboardInterrupt``: recorded without a traceback, exit 130; the launcher says it once);
- on every path: destroys any process group still alive, then leaves through ``os._exit`` after
  running ``atexit`` handlers and flushing stdio — see :func:`shutdown_and_exit` for why;
- in a restarted attempt (``--max-restarts``): rank 0 says so in one line first;
- for a native crash (a gloo abort, a segfault): ``faulthandler`` prints every thread's Python
  stack, and the last bytes of stderr are kept in the run folder for the launcher's summary
  (:mod:`ddpkit.launch.stderr_tail`).
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import runpy
import signal
import sys

# Before the user's script can create a process group: applies the import-order fix in there.
import ddpkit.runtime.process_group  # noqa: F401
from ddpkit.diagnostics.failures import (
    LAUNCHER_PID_ENV,
    RUN_DIR_ENV,
    make_record,
    register_bootstrap_file,
    write_done_record,
    write_record,
    write_stop_record,
)
from ddpkit.launch.elastic import ELASTIC_ENV
from ddpkit.live.outcomes import LeftTheJob
from ddpkit.runtime.stop import TrainingStopped, default_stop_signals, stop_agreed_elsewhere
from ddpkit.security.bind import MASTER_PORT_ENV

register_bootstrap_file(__file__)  # failure tracebacks start at the user's script


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def destroy_process_groups() -> None:
    """Destroy the default process group (and every subgroup) if the script left one alive."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def shutdown_and_exit(code: int) -> None:
    """Destroy process groups, run ``atexit`` handlers, flush, and end the process with ``code``.

    Why not a normal interpreter exit: a gloo process group that something still references
    after ``destroy_process_group`` keeps its C++ threads running into interpreter finalization,
    and tearing them down there aborts ("terminate called without an active exception", exit
    134) or hangs in a few percent of correct runs. ddpkit removes the reference torch itself
    leaves behind (see :mod:`ddpkit.runtime.process_group`), but a user's script can hold
    others (a global DDP model, its own late imports). After the script and the ``atexit``
    handlers have run nothing is left worth finalizing, so the bootstrap skips finalization.
    """
    try:
        destroy_process_groups()
    except Exception as exc:  # a broken peer must not turn success into a hang or a traceback
        print(
            f"ddpkit: process group teardown failed: {type(exc).__name__}: {exc}", file=sys.stderr
        )
        code = code or 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def line_buffer_stdio() -> None:
    """Make stdout and stderr line-buffered, so each line reaches the shared pipe in one write.

    torchrun starts workers with ``python -u`` (unbuffered): ``print`` then writes the text and
    its newline separately, and two ranks' lines interleave mid-line.
    """
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        try:
            fd = stream.fileno()
        except (AttributeError, OSError, ValueError):
            continue  # replaced by something without a file descriptor; leave it alone
        stream.flush()
        setattr(
            sys,
            name,
            open(
                fd, "w", buffering=1, encoding=stream.encoding, errors=stream.errors, closefd=False
            ),
        )


def _record_failure(exc: BaseException, show_traceback: bool) -> None:
    record = make_record(exc)
    if os.environ.get(RUN_DIR_ENV):
        write_record(record, os.environ[RUN_DIR_ENV])
    if show_traceback:
        prefix = f"[rank {record.rank}/{record.world_size}]"
        lines = record.traceback.rstrip("\n").splitlines() or [f"{record.type}: {record.message}"]
        if record.hint and record.hint not in record.traceback:  # not already a note in it
            lines.append(f"ddpkit hint: {record.hint}")
        print("\n".join(f"{prefix} {line}" for line in lines), file=sys.stderr, flush=True)


def run_target(argv: list[str]) -> int:
    """Run ``script.py args`` or ``-m module args`` as ``__main__``; return the exit status.

    A non-zero ``SystemExit`` is recorded like an exception (without a traceback), so the
    launcher can name a rank that called ``sys.exit(3)`` or failed its argument parsing.
    """
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        print(
            "usage: python -m ddpkit.launch.worker [-m module | script.py] [args...]",
            file=sys.stderr,
        )
        return 2
    try:
        _run_as_main(argv)
    except TrainingStopped as exc:  # every rank stopped at one step: the launcher says it once
        return _stopped(exc)
    except LeftTheJob:  # live: it left on its own signal, the job goes on
        return 0
    except SystemExit as exc:
        code = _exit_code(exc)
        if code != 0:
            _record_failure(exc, show_traceback=False)
            return code
    except KeyboardInterrupt as exc:  # Ctrl-C: recorded; the launcher prints one line per job
        _record_failure(exc, show_traceback=False)
        return 130
    except BaseException as exc:  # noqa: BLE001 - every escape is recorded
        _record_failure(exc, show_traceback=True)
        return 1
    agreed = stop_agreed_elsewhere()  # the script broke out of its loop on rt.stop_requested()
    if agreed is not None and os.environ.get(ELASTIC_ENV):
        return 128 + agreed  # as _stopped does for another node's stop: the agent restarts us
    if os.environ.get(RUN_DIR_ENV):  # a stop signal that came too late finds the job completed
        write_done_record(os.environ[RUN_DIR_ENV])
    return 0


def _run_as_main(argv: list[str]) -> None:
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(argv[0])
        sys.argv = [argv[0], *argv[1:]]
        sys.path.insert(0, os.path.dirname(script))
        runpy.run_path(script, run_name="__main__")


def _stopped(exc: TrainingStopped) -> int:
    """Under ``ddpkit run``: the stop record (unless the runtime wrote it), and exit 0 after a
    clean stop; elsewhere 128 + the signal.

    Elastic (``--nnodes MIN:MAX``), a stop no process of this node was signalled for came from
    another node: its agent restarting the workers to take a node in, or that node leaving. The
    ranks stopped and saved at one step; exiting 128 + the signal (not 0, which would end this
    node's part of the job) makes this node's agent restart the workers into the next
    rendezvous, where they resume from that checkpoint, as they would after a failure.
    """
    if not os.environ.get(RUN_DIR_ENV):
        return exc.code
    if not exc.recorded:  # raised outside the runtime's with block
        write_stop_record(exc, os.environ[RUN_DIR_ENV])
    if os.environ.get(ELASTIC_ENV) and not exc.here:
        return exc.code
    return exc.code if exc.now else 0


def die_with_launcher() -> None:
    """Ask Linux to SIGKILL this worker when its launcher dies (``PR_SET_PDEATHSIG``).

    torchrun stops its workers when it exits normally or on SIGTERM/SIGINT, but a launcher killed
    with SIGKILL (or OOM-killed) would leave them training as orphans. A no-op off Linux.
    """
    launcher_pid = os.environ.get(LAUNCHER_PID_ENV)
    if not sys.platform.startswith("linux") or not launcher_pid:
        return
    import ctypes

    pr_set_pdeathsig = 1  # from <linux/prctl.h>
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    # The launcher may have died before prctl took effect: then we are already orphaned.
    if os.getppid() != int(launcher_pid):
        os._exit(1)


def keep_stderr_tail() -> None:
    """Under ``ddpkit run``: keep this rank's last stderr bytes in the run folder (see
    :mod:`ddpkit.launch.stderr_tail`), and dump every thread's Python stack on a native crash.

    Not when stderr is a terminal: a pipe in between would make the script's own ``isatty()``
    checks (progress bars, colours) answer no. There the user reads gloo's abort message on the
    terminal itself, and the launcher's summary names the rank and signal without it.
    """
    run_dir = os.environ.get(RUN_DIR_ENV)
    if run_dir and not os.isatty(2):
        from ddpkit.launch.stderr_tail import tail_path, tee_stderr

        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        tee_stderr(tail_path(run_dir, restart, int(os.environ.get("RANK", 0))))


def say_restart() -> None:
    """Rank 0 of a restarted attempt says so in one line: the failure above it was not the end.

    Without it, a restart under ``--max-restarts`` shows a rank's error, torchrun's log lines,
    then the job's first lines again, with nothing between them saying the job goes on.
    """
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if restart and os.environ.get("RANK", "0") == "0":
        print(
            f"ddpkit: restart {restart} of {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}: "
            "the job failed (the error above); all "
            f"{os.environ.get('WORLD_SIZE', '?')} processes start again",
            file=sys.stderr,
            flush=True,
        )


def release_stop_signals(argv: list[str]) -> None:
    """Unblock the stop signals ddpkit's launcher started this worker with, unless the target
    is ``ddpkit train``, whose runtime unblocks them once it waits for them.

    The launcher blocks them so that a signal reaching a rank while it starts (importing
    torch, joining the rendezvous) stays pending instead of ending it. Any other script gets
    the usual behaviour from its first line (``ddpkit.init_runtime`` installs the handlers
    later).
    """
    if argv[:3] != ["-m", "ddpkit", "train"]:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, default_stop_signals())


def use_reserved_port() -> None:
    """``MASTER_PORT``: the port ``ddpkit run`` holds for rank 0's store on one node
    (:func:`ddpkit.security.bind.reserve_port`), in place of torchrun's pick, which another
    program could take before rank 0 listens on it."""
    if os.environ.get(MASTER_PORT_ENV):
        os.environ["MASTER_PORT"] = os.environ[MASTER_PORT_ENV]


def main() -> None:
    use_reserved_port()
    release_stop_signals(sys.argv[1:])
    die_with_launcher()
    keep_stderr_tail()
    say_restart()
    line_buffer_stdio()
    faulthandler.enable(all_threads=True)  # a native crash still shows where Python was
    shutdown_and_exit(run_target(sys.argv[1:]))


if __name__ == "__main__":
    main()
