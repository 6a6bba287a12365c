"""A multi-process harness for testing distributed code on CPU: real processes, gloo, no ports.

    from ddpkit.testing import run_distributed

    def check_sum(runtime, value):            # module level, so spawn can import it
        return ddpkit.all_reduce_sum([value], runtime).item()

    def test_sum():
        assert run_distributed(check_sum, world_size=3, args=(2.0,)) == [6.0, 6.0, 6.0]

What it guarantees:

- one process per rank, forked from a *forkserver* that has already imported torch,
  ``torch._dynamo`` (which DDP imports at its first construction), the DDP comm hooks and ddpkit
  (:data:`PRELOAD`): a rank starts in milliseconds instead of the ~3 s a fresh interpreter needs.
  Each rank still gets the caller's current environment and working folder. Pass
  ``start_method="spawn"`` where a test needs a virgin interpreter (import order, shutdown);
- one string-hash salt for every rank of a run, as under ``ddpkit run``: forked ranks share
  the forkserver's, spawned ones start with one ``PYTHONHASHSEED``;
- rendezvous through a ``FileStore`` in a fresh temporary folder (no port is ever chosen, so no
  race and no collision between tests);
- three nested timeouts: the process group's (``pg_timeout_s``), the harness's (``timeout_s``,
  which kills every rank), and pytest-timeout above both;
- the first failure (an exception, or a process that died) kills every rank at once and raises
  :class:`DistributedTestError` holding each failed rank's traceback; a rank killed so takes
  the processes it started (DataLoader workers, a subprocess) with it;
- workers leave through ddpkit's shutdown path, so the gloo exit-time abort cannot flake a test.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.forkserver
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import ddpkit
from ddpkit.env import descendant_pids
from ddpkit.runtime.hashseed import HASH_SEED_ENV, job_hash_seed

# What the forkserver imports once, so every rank forked from it starts warm. torch._dynamo is
# most of DDP's first construction (2.9 of 2.95 s); the comm hooks, most of a hooked DDP's.
# ``import ddpkit`` alone imports none of the public API (each name on first use): its modules.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch.nn.parallel",
    "torch.distributed.algorithms.ddp_comm_hooks",
    "ddpkit",
    *sorted(set(ddpkit._API_MODULES.values())),
    "ddpkit.launch.spawn",
)


class DistributedTestError(AssertionError):
    """A rank failed, died or timed out; the message carries every failed rank's traceback.

    Attributes:
        header: the first line: ``"1 of 2 rank(s) failed"`` or ``"timed out after ..."``.
        failures: ``{rank: traceback text, or "died with exit code N"}`` of the failed ranks.
    """

    def __init__(self, header: str, failures: dict[int, str] | None = None) -> None:
        self.header = header
        self.failures = dict(failures or {})
        blocks = [
            f"--- rank {rank} {text}"
            if text.startswith("died")
            else f"--- rank {rank} raised:\n{text}"
            for rank, text in self.failures.items()
        ]
        super().__init__("\n".join([header + (":" if blocks else ""), *blocks]))

    def first_cause(self) -> str:
        """One line: ``"rank R raised: <last traceback line>"``, ``"rank R died with exit code
        N"``, or the header when no rank failed (a timeout)."""
        for rank, text in self.failures.items():
            if text.startswith("died"):
                return f"rank {rank} {text}"
            last = [line.strip() for line in text.splitlines() if line.strip()] or ["?"]
            return f"rank {rank} raised: {last[-1]}"
        return self.header


def _worker(
    fn: Callable[..., Any],
    args: Sequence[Any],
    rank: int,
    world_size: int,
    workdir: str,
    pg_timeout_s: float,
    init: bool,
    env: dict[str, str],
    backend: str = "gloo",
    parent_env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> None:
    from ddpkit.launch.worker import shutdown_and_exit

    if parent_env is not None:  # forked from the forkserver: take the caller's, not its, state
        os.environ.clear()
        os.environ.update(parent_env)
    if cwd is not None:
        os.chdir(cwd)
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    os.environ.pop("MASTER_ADDR", None)
    os.environ.pop("MASTER_PORT", None)
    try:
        import torch
        import torch.distributed as dist

        from ddpkit.runtime.process_group import init_runtime

        torch.set_num_threads(1)  # OMP_NUM_THREADS is read once, before a forked rank begins

        store = dist.FileStore(os.path.join(workdir, "store"), world_size)
        if init:
            with init_runtime(
                backend, init_timeout_s=pg_timeout_s, train_timeout_s=pg_timeout_s, store=store
            ) as runtime:
                outcome = ("ok", fn(runtime, *args))
        else:
            outcome = ("ok", fn(store, *args))
    except BaseException:  # noqa: BLE001 - carried back to the parent whatever it is
        outcome = ("error", traceback.format_exc())
    path = Path(workdir) / f"result-{rank}.pkl"
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_bytes(pickle.dumps(outcome))
    except Exception:  # an unpicklable return value
        tmp.write_bytes(pickle.dumps(("error", traceback.format_exc())))
    os.replace(tmp, path)
    shutdown_and_exit(0 if outcome[0] == "ok" else 1)


def _kill_all(procs: list[mp.process.BaseProcess]) -> None:
    """SIGKILL every rank still running, and the processes below it: a DataLoader worker of a
    killed rank lives on otherwise, for good where it hangs (a child stuck in ``os.fork()``,
    CPython gh-112275). A rank that already ended has no descendants to find: its children
    then belong to init."""
    for proc in procs:
        if proc.is_alive():  # not reaped: its pid, and its children's parent pid, are its own
            below = descendant_pids(cast(int, proc.pid))
            proc.kill()
            for pid in below:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
    for proc in procs:
        proc.join(timeout=10)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    timeout_s: float = 60.0,
    pg_timeout_s: float = 30.0,
    init: bool = True,
    env: dict[str, str] | None = None,
    start_method: str = "forkserver",
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn`` on ``world_size`` new processes (gloo ranks) and return each rank's result.

    Args:
        fn: a module-level function. With ``init`` it is called as ``fn(runtime, *args)`` inside
            a :class:`~ddpkit.Runtime` (gloo unless ``backend`` says otherwise); without, as
            ``fn(store, *args)`` with the rank variables set and a shared ``FileStore`` to
            rendezvous through (to test code that initialises the group itself).
        world_size: number of ranks (processes).
        args: picklable extra arguments.
        timeout_s: the harness limit for the whole run, in seconds; every rank is killed then.
        pg_timeout_s: the process group's init and collective timeout, in seconds.
        init: create the process group (through a ``FileStore``) before calling ``fn``.
        env: extra environment variables for every rank (``PYTHONHASHSEED`` takes effect
            with ``spawn`` only: a forked rank keeps its parent's string-hash salt).
        start_method: ``forkserver`` (default: ranks forked from a server that preloaded
            :data:`PRELOAD`, given this process's environment and working folder), ``spawn``
            (a virgin interpreter per rank, ~3 s slower) or ``fork``; ``fork`` is refused once
            CUDA is initialised in this process.
        backend: the process group's backend with ``init``: ``gloo`` (default), ``nccl`` (one
            CUDA device per rank, ``cuda:<rank>``) or ``auto`` (see
            :func:`ddpkit.runtime.process_group.resolve_backend`).

    Returns:
        ``[result of rank 0, result of rank 1, ...]`` (results must be picklable).

    Raises:
        DistributedTestError: a rank raised, died, or the run exceeded ``timeout_s``.
        ConfigError: ``fork`` asked for after CUDA was initialised (see
            :func:`ddpkit.diagnostics.translate.check_start_method`).
    """
    from ddpkit.diagnostics.translate import check_start_method

    check_start_method(start_method)
    # A checked name: one of these three contexts (typeshed types get_context(str) as their
    # base class, which has no Process).
    ctx = cast(
        "mp.context.ForkServerContext | mp.context.SpawnContext | mp.context.ForkContext",
        mp.get_context(start_method),
    )
    forked = start_method == "forkserver"
    if forked:
        _ensure_forkserver()
    workdir = tempfile.mkdtemp(prefix="ddpkit-test-")
    state = (dict(os.environ), os.getcwd()) if forked else (None, None)
    procs: list[mp.process.BaseProcess] = [
        ctx.Process(
            target=_worker,
            args=(
                fn,
                args,
                rank,
                world_size,
                workdir,
                pg_timeout_s,
                init,
                env or {},
                backend,
                *state,
            ),
            name=f"rank{rank}",
        )
        for rank in range(world_size)
    ]
    try:
        _start(procs, start_method, workdir, env or {})
        return _collect(procs, Path(workdir), timeout_s)
    finally:
        _kill_all(procs)
        shutil.rmtree(workdir, ignore_errors=True)


def _start(
    procs: list[mp.process.BaseProcess], start_method: str, workdir: str, env: dict[str, str]
) -> None:
    """Start every rank, with one string-hash salt for the run.

    ``spawn``: each rank's interpreter reads ``PYTHONHASHSEED`` as it starts, before ``env`` is
    applied, so this process's environment holds the seed while they start: ``env``'s, else
    this process's, else one derived from the run's folder (as ``ddpkit run`` derives one from
    its run id). Forked ranks (forkserver, fork) keep their parent's salt: they agree already,
    and a ``PYTHONHASHSEED`` in ``env`` cannot change their ``hash()``.
    """
    saved = os.environ.get(HASH_SEED_ENV)
    if start_method == "spawn":
        os.environ[HASH_SEED_ENV] = env.get(HASH_SEED_ENV) or saved or str(job_hash_seed(workdir))
    try:
        for proc in procs:
            proc.start()
    finally:
        if saved is None:
            os.environ.pop(HASH_SEED_ENV, None)
        else:
            os.environ[HASH_SEED_ENV] = saved


def _ensure_forkserver() -> None:
    """Start the forkserver with :data:`PRELOAD` (once per process; a no-op while it runs).

    It starts from a clean slate: one OpenMP thread (read when torch loads) and none of the
    launcher variables a test may have set at that moment.
    """
    mp.set_forkserver_preload(list(PRELOAD))
    saved = dict(os.environ)
    for name in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        os.environ.pop(name, None)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _collect(procs: list[mp.process.BaseProcess], workdir: Path, timeout_s: float) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    results: dict[int, Any] = {}
    while len(results) < len(procs):
        failures: dict[int, str] = {}
        for rank, proc in enumerate(procs):
            if rank in results:
                continue
            path = workdir / f"result-{rank}.pkl"
            if path.exists():
                status, value = pickle.loads(path.read_bytes())
                if status == "error":
                    failures[rank] = value
                results[rank] = value
            elif not proc.is_alive() and not path.exists():  # exited without a result
                failures[rank] = f"died with exit code {proc.exitcode}"
                results[rank] = None
        if failures:
            _kill_all(procs)
            raise DistributedTestError(f"{len(failures)} of {len(procs)} rank(s) failed", failures)
        if time.monotonic() > deadline:
            missing = [rank for rank in range(len(procs)) if rank not in results]
            _kill_all(procs)
            raise DistributedTestError(
                f"timed out after {timeout_s:g} s; ranks still running: {missing}"
            )
        time.sleep(0.02)
    return [results[rank] for rank in range(len(procs))]
