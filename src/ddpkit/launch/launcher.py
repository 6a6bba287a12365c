"""Hand a script to ``torch.distributed.run`` (torchrun) on this node, and report failures plainly.

What ddpkit adds over calling torchrun yourself:

- a standalone c10d rendezvous on ``localhost:0``: the store binds a port the OS picks, so no
  "free port" guess can race with another job;
- ``OMP_NUM_THREADS`` set to the usable cores divided by the number of processes (when unset);
- every worker runs under :mod:`ddpkit.launch.worker`, which records the first failure and shuts
  the process group down so the job never aborts at exit;
- a closing summary that names the rank that failed *first*, with its exception type and message.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import dataclass

from ddpkit.errors import ConfigError
from ddpkit.launch.failures import RUN_DIR_ENV, FailureRecord, read_records

WORKER_MODULE = "ddpkit.launch.worker"


@dataclass(frozen=True)
class LaunchSpec:
    """What to start.

    Attributes:
        target: ``["script.py", *args]`` or ``["-m", "module", *args]``.
        nproc: processes on this node (the world size, single node).
        max_restarts: how many times torchrun restarts the whole group after a failure.
        omp_num_threads: threads per process; ``None`` = usable cores // nproc (at least 1).
    """

    target: list[str]
    nproc: int
    max_restarts: int = 0
    omp_num_threads: int | None = None


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def validate_spec(spec: LaunchSpec) -> None:
    """Check a whole :class:`LaunchSpec` at once; one error lists every problem.

    Raises:
        ConfigError: nproc or max_restarts out of range, a missing script, an empty target.
    """
    problems = []
    if isinstance(spec.nproc, bool) or not isinstance(spec.nproc, int) or spec.nproc < 1:
        problems.append(f"nproc={spec.nproc!r} must be an integer >= 1")
    if spec.max_restarts < 0:
        problems.append(f"max_restarts={spec.max_restarts} must be >= 0")
    if not spec.target or spec.target == ["-m"]:
        problems.append("no script given (ddpkit run -n 2 train.py [args], or -m package.module)")
    elif spec.target[0] != "-m" and not os.path.isfile(spec.target[0]):
        problems.append(f"script={spec.target[0]!r} does not exist")
    if problems:
        raise ConfigError(f"invalid launch: {'; '.join(problems)}.")


def torchrun_argv(spec: LaunchSpec) -> list[str]:
    """The ``torch.distributed.run`` command line for ``spec`` (without the program name)."""
    return [
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={spec.nproc}",
        f"--max-restarts={spec.max_restarts}",
        "--monitor-interval=0.1",
        "--module",
        WORKER_MODULE,
        *spec.target,
    ]


def summarize_failure(
    records: list[FailureRecord], exit_codes: dict[int, int], spec: LaunchSpec
) -> list[str]:
    """The closing lines of a failed job: the first failure, then how the job ended.

    Args:
        records: failure records of the final attempt, oldest first.
        exit_codes: rank -> exit status as torchrun reported it (negative: killed by a signal).
        spec: the launch.
    """
    import signal

    lines = []
    recorded = {r.rank for r in records}
    signals = {
        rank: signal.Signals(-code).name
        for rank, code in exit_codes.items()
        if code < 0 and rank not in recorded
    }
    # SIGTERM is how torchrun stops the survivors; count it as a cause only if nothing else is.
    crashed = {rank: name for rank, name in signals.items() if name != "SIGTERM"} or signals
    for rank, name in sorted(crashed.items()):
        lines.append(
            f"ddpkit run: first failure: rank {rank}/{spec.nproc} died from signal {name} "
            "without a Python exception."
        )
    if records:
        first = records[0]
        lines.append(f"ddpkit run: {'then' if crashed else 'first failure'}: {first.headline}")
        tail = [line for line in first.traceback.rstrip().splitlines()[-4:-1] if line.strip()]
        lines += [f"ddpkit run:   {line.strip()}" for line in tail]
    elif not crashed:
        ranks = ", ".join(f"rank {r} exit {c}" for r, c in sorted(exit_codes.items()))
        lines.append(f"ddpkit run: workers failed without a Python exception: {ranks}.")
    restarts = (
        "restarts are off (--max-restarts 0); add --max-restarts N to restart the workers"
        if spec.max_restarts == 0
        else f"gave up after {spec.max_restarts} restart(s)"
    )
    lines.append(f"ddpkit run: job FAILED; all {spec.nproc} processes stopped; {restarts}.")
    return lines


def launch(spec: LaunchSpec) -> int:
    """Start ``spec.nproc`` workers through torchrun and wait for them.

    Returns:
        0 when every worker exited 0; 1 when one failed (after the summary is printed to
        stderr); 130 when interrupted.

    Raises:
        ConfigError: an invalid :class:`LaunchSpec`.
    """
    validate_spec(spec)
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    run_dir = tempfile.mkdtemp(prefix="ddpkit-run-")
    threads = spec.omp_num_threads or max(1, _usable_cores() // spec.nproc)
    saved = dict(os.environ)
    os.environ.update({"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads))})
    os.environ[RUN_DIR_ENV] = run_dir
    try:
        torchrun.run(torchrun.parse_args(torchrun_argv(spec)))
        return 0
    except ChildFailedError as exc:
        attempt = max((r.restart for r in read_records(run_dir)), default=0)
        records = [r for r in read_records(run_dir) if r.restart == attempt]
        codes = {rank: failure.exitcode for rank, failure in exc.failures.items()}
        for line in summarize_failure(records, codes, spec):
            print(line, file=sys.stderr)
        return 1
    except (SignalException, KeyboardInterrupt) as exc:
        print(f"ddpkit run: interrupted ({exc}); all workers stopped.", file=sys.stderr)
        return 130
    finally:
        os.environ.clear()
        os.environ.update(saved)
        shutil.rmtree(run_dir, ignore_errors=True)
