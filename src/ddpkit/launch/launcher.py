"""Hand a script to ``torch.distributed.run`` (torchrun) on this node, and report failures plainly.

What ddpkit adds over calling torchrun yourself:

- a c10d rendezvous whose store ddpkit itself hosts, listening on 127.0.0.1 only, on a port the
  OS picks (torchrun's own stores listen on every interface); workers find their rank-0 store
  at 127.0.0.1 and gloo binds the loopback interface (``GLOO_SOCKET_IFNAME=lo``), so nothing
  outside this machine can reach any of the job's ports;
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
import uuid
from dataclasses import dataclass

import torch.distributed as dist

from ddpkit.errors import ConfigError
from ddpkit.launch.failures import LAUNCHER_PID_ENV, RUN_DIR_ENV, FailureRecord, read_records
from ddpkit.security.bind import listening_socket

WORKER_MODULE = "ddpkit.launch.worker"


@dataclass(frozen=True)
class LaunchSpec:
    """What to start.

    Attributes:
        target: ``["script.py", *args]`` or ``["-m", "module", *args]``.
        nproc: processes on this node (the world size, single node).
        max_restarts: how many times torchrun restarts the whole group after a failure.
        omp_num_threads: threads per process; ``None`` keeps an ``OMP_NUM_THREADS`` already set,
            else usable cores // nproc (at least 1).
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


def _find_module(name: str) -> object | None:
    import importlib.util

    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a parent package that is missing, or an empty name
        return None


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
    if spec.omp_num_threads is not None and spec.omp_num_threads < 1:
        problems.append(f"omp_num_threads={spec.omp_num_threads} must be >= 1")
    if not spec.target or spec.target == ["-m"]:
        problems.append("no script given (ddpkit run -n 2 train.py [args], or -m package.module)")
    elif spec.target[0] == "-m":
        if _find_module(spec.target[1]) is None:
            problems.append(f"module={spec.target[1]!r} cannot be found on sys.path")
    elif not os.path.exists(spec.target[0]):
        problems.append(f"script={spec.target[0]!r} does not exist")
    elif not os.path.isfile(spec.target[0]):
        problems.append(f"script={spec.target[0]!r} is not a file")
    if problems:
        raise ConfigError(f"invalid launch: {'; '.join(problems)}.")


def torchrun_argv(spec: LaunchSpec, rdzv_endpoint: str, run_id: str) -> list[str]:
    """The ``torch.distributed.run`` command line for ``spec`` (without the program name).

    ``rdzv_endpoint`` (``host:port``) is a TCPStore the caller already hosts: torchrun's agent
    only connects to it (``is_host=false``), and advertises ``127.0.0.1`` to the workers.
    """
    return [
        "--nnodes=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_endpoint}",
        f"--rdzv-id={run_id}",
        "--rdzv-conf=is_host=false",
        "--local-addr=127.0.0.1",
        f"--nproc-per-node={spec.nproc}",
        f"--max-restarts={spec.max_restarts}",
        "--monitor-interval=0.1",
        "--module",
        "--",  # the rest is ours: torchrun's parser must not read "--nproc 2" as its own option
        WORKER_MODULE,
        *spec.target,
    ]


def _traceback_tail(text: str, num_lines: int = 3) -> list[str]:
    """The last frame lines of a traceback, without the exception line and caret markers."""
    lines = [line.strip() for line in text.rstrip().splitlines()[:-1]]
    lines = [line for line in lines if line and set(line) - set("^~ ")]
    return lines[-num_lines:] if lines and lines[0].startswith("Traceback") else []


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
    unrecorded = {rank: code for rank, code in exit_codes.items() if rank not in recorded}
    signals = {rank: signal.Signals(-code).name for rank, code in unrecorded.items() if code < 0}
    # SIGTERM is how torchrun stops the survivors; count it as a cause only if nothing else is.
    crashed = {rank: name for rank, name in signals.items() if name != "SIGTERM"}
    if not crashed and not records:
        crashed = signals
    for rank, name in sorted(crashed.items()):
        lines.append(
            f"ddpkit run: first failure: rank {rank}/{spec.nproc} died from signal {name} "
            "without a Python exception."
        )
    if records:
        first = records[0]
        lines.append(f"ddpkit run: {'then' if crashed else 'first failure'}: {first.headline}")
        lines += [f"ddpkit run:   {line}" for line in _traceback_tail(first.traceback)]
        if first.hint:
            lines.append(f"ddpkit run: hint: {first.hint}")
    exited = {rank: code for rank, code in unrecorded.items() if code > 0}
    if exited:
        ranks = ", ".join(f"rank {r} exit status {c}" for r, c in sorted(exited.items()))
        lines.append(f"ddpkit run: also failed without a Python exception: {ranks}.")
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
        stderr); 128 + the signal number when the launcher itself was stopped by a signal.

    Raises:
        ConfigError: an invalid :class:`LaunchSpec`.
    """
    validate_spec(spec)
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    run_dir = tempfile.mkdtemp(prefix="ddpkit-run-")
    saved = dict(os.environ)
    rdzv_store = host_rendezvous_store("127.0.0.1")
    # Workers: no shared agent store (it would listen on every interface); rank 0 serves the
    # job's store on 127.0.0.1 (ddpkit's make_store), and gloo binds the loopback interface.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    if spec.omp_num_threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(spec.omp_num_threads)
    else:
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _usable_cores() // spec.nproc)))
    os.environ[RUN_DIR_ENV] = run_dir
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    try:
        argv = torchrun_argv(spec, f"127.0.0.1:{rdzv_store.port}", uuid.uuid4().hex)
        torchrun.run(torchrun.parse_args(argv))
        return 0
    except ChildFailedError as exc:
        records = read_records(run_dir)
        attempt = max((r.restart for r in records), default=0)
        records = [r for r in records if r.restart == attempt]
        codes = {rank: failure.exitcode for rank, failure in exc.failures.items()}
        for line in summarize_failure(records, codes, spec):
            print(line, file=sys.stderr)
        return 1
    except SignalException as exc:  # SIGTERM, SIGHUP, ... sent to the launcher
        print(f"ddpkit run: stopped by {exc.sigval.name}; all workers stopped.", file=sys.stderr)
        return 128 + int(exc.sigval)
    except KeyboardInterrupt:
        print("ddpkit run: interrupted; all workers stopped.", file=sys.stderr)
        return 130
    finally:
        os.environ.clear()
        os.environ.update(saved)
        shutil.rmtree(run_dir, ignore_errors=True)
        del rdzv_store


def host_rendezvous_store(address: str) -> dist.TCPStore:
    """A TCPStore for torchrun's c10d rendezvous, listening on ``address`` only (port: OS pick).

    Raises:
        ConfigError: ``address`` is not one of this machine's.
    """
    listener = listening_socket(address, 0)
    port = listener.getsockname()[1]
    return dist.TCPStore(
        address,
        port,
        is_master=True,
        wait_for_workers=False,
        multi_tenant=True,
        master_listen_fd=listener.detach(),
        use_libuv=True,
    )
