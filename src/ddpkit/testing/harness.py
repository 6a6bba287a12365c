"""A multi-process harness for testing distributed code on CPU: real processes, gloo, no ports.

    from ddpkit.testing import run_distributed

    def check_sum(runtime, value):            # module level, so spawn can import it
        return ddpkit.all_reduce_sum([value], runtime).item()

    def test_sum():
        assert run_distributed(check_sum, world_size=3, args=(2.0,)) == [6.0, 6.0, 6.0]

What it guarantees:

- ``spawn`` start method, one process per rank, rendezvous through a ``FileStore`` in a fresh
  temporary folder (no port is ever chosen, so no race and no collision between tests);
- three nested timeouts: the process group's (``pg_timeout_s``), the harness's (``timeout_s``,
  which kills every rank), and pytest-timeout above both;
- the first failure (an exception, or a process that died) kills every rank at once and raises
  :class:`DistributedTestError` holding each failed rank's traceback;
- workers leave through ddpkit's shutdown path, so the gloo exit-time abort cannot flake a test.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


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
            f"--- rank {rank} {text}" if text.startswith("died") else
            f"--- rank {rank} raised:\n{text}"
            for rank, text in self.failures.items()
        ]  # fmt: skip
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
) -> None:
    from ddpkit.launch.worker import shutdown_and_exit

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
        import torch.distributed as dist

        from ddpkit.distributed.process_group import init_runtime

        store = dist.FileStore(os.path.join(workdir, "store"), world_size)
        if init:
            with init_runtime(backend, pg_timeout_s, pg_timeout_s, store=store) as runtime:
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
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(timeout=10)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    timeout_s: float = 60.0,
    pg_timeout_s: float = 30.0,
    init: bool = True,
    env: dict[str, str] | None = None,
    start_method: str = "spawn",
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn`` on ``world_size`` spawned ranks and return each rank's result.

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
        env: extra environment variables for every rank.
        start_method: ``spawn`` (default, always safe) or ``forkserver``/``fork``; ``fork`` is
            refused once CUDA is initialised in this process.
        backend: the process group's backend with ``init``: ``gloo`` (default), ``nccl`` (one
            CUDA device per rank, ``cuda:<rank>``) or ``auto`` (see
            :func:`ddpkit.distributed.process_group.resolve_backend`).

    Returns:
        ``[result of rank 0, result of rank 1, ...]`` (results must be picklable).

    Raises:
        DistributedTestError: a rank raised, died, or the run exceeded ``timeout_s``.
        ConfigError: ``fork`` asked for after CUDA was initialised (see
            :func:`ddpkit.diagnostics.translate.check_start_method`).
    """
    from ddpkit.diagnostics.translate import check_start_method

    check_start_method(start_method)
    ctx = mp.get_context(start_method)
    workdir = tempfile.mkdtemp(prefix="ddpkit-test-")
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, args, rank, world_size, workdir, pg_timeout_s, init, env or {}, backend),
            name=f"rank{rank}",
        )
        for rank in range(world_size)
    ]
    try:
        for proc in procs:
            proc.start()
        return _collect(procs, Path(workdir), timeout_s)
    finally:
        _kill_all(procs)
        shutil.rmtree(workdir, ignore_errors=True)


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
