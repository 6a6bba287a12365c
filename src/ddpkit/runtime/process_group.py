"""Process-group set-up and teardown: backend choice, device per local rank, two timeouts.

The default (WORLD) group is created with the *init* timeout, which bounds the rendezvous: how
long a rank waits for the others to join. Training collectives run on a second group over the same
ranks, created with ``torch.distributed.new_group(timeout=train_timeout_s)``, which bounds how long
any collective may wait. :attr:`Runtime.process_group` is that training group; DDP and ddpkit's
collectives use it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import faulthandler
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# Imported before any process group exists, on purpose. Its functions take ``group=group.WORLD``
# as a default argument, evaluated at import time. DDP imports the module lazily, i.e. *after*
# ``init_process_group``, so the live default group gets captured in those defaults forever:
# ``destroy_process_group`` can then never free it, and gloo's worker threads (pt_gloo_runloop,
# gloo_tcp_loop) live on into interpreter finalization, where tearing them down aborts ("terminate
# called without an active exception", exit 134) or hangs in a few percent of correct runs.
# Imported here, first, the defaults capture ``None`` and the group is freed when destroyed.
if dist.is_available():
    import torch.distributed.nn.functional  # noqa: F401  (see above)

from ddpkit.diagnostics.failures import (
    RUN_DIR_ENV,
    record_failure,
    stamp_failure_time,
    write_stop_record,
)
from ddpkit.diagnostics.peers import PEER_ENDED, TOLD_ENDED, TOLD_SILENT, mentions
from ddpkit.env import ProcessInfo, detect_process_info, slurm_rendezvous_defaults
from ddpkit.errors import ConfigError, DistributedError
from ddpkit.live.membership import LiveMembership
from ddpkit.live.outcomes import LeftTheJob
from ddpkit.live.protocol import Quorum
from ddpkit.live.start import join_live, wants_live
from ddpkit.log import follow_rank_change
from ddpkit.runtime.choices import BACKENDS  # torch-free: the train flags read them
from ddpkit.runtime.config import (  # torch-free: ddpkit train's [runtime] settings read them
    INIT_TIMEOUT_S,
    STALL_TIMEOUT_S,
    TRAIN_TIMEOUT_S,
    watchdog_timeout_rule,
)
from ddpkit.runtime.hashseed import warn_if_str_hashes_differ
from ddpkit.runtime.rendezvous import (
    check_local_route,
    check_world_size_limit,
    join,
    make_store,
    round_store,
)
from ddpkit.runtime.stop import StopRequest, TrainingStopped, default_stop_signals
from ddpkit.security.token import load_token
from ddpkit.watchdog.monitor import Watchdog


def resolve_backend(backend: str, info: ProcessInfo) -> str:
    """Pick the communication backend.

    ``auto`` gives ``nccl`` when CUDA is available and every local rank has a GPU of its own
    (``torch.cuda.device_count() >= local_world_size``), else ``gloo``.

    Raises:
        ConfigError: ``backend`` is not one of ``auto``, ``gloo``, ``nccl``; or ``nccl`` is asked
            for where CUDA or NCCL is missing.
    """
    if backend not in BACKENDS:
        raise ConfigError(
            f"unknown backend: backend={backend!r}. Allowed: {', '.join(BACKENDS)}. "
            "Use 'auto' to pick nccl on GPUs and gloo on CPU."
        )
    has_gpu_each = torch.cuda.is_available() and torch.cuda.device_count() >= info.local_world_size
    if backend == "auto":
        return "nccl" if has_gpu_each and dist.is_nccl_available() else "gloo"
    if backend == "nccl" and not (has_gpu_each and dist.is_nccl_available()):
        raise ConfigError(
            f"backend=nccl needs one CUDA device per local rank and an NCCL build of torch: "
            f"found {torch.cuda.device_count()} device(s) for {info.local_world_size} local "
            f"rank(s), nccl available={dist.is_nccl_available()}. Use backend='gloo' (or 'auto')."
        )
    return backend


@dataclass
class Runtime:
    """The distributed state one process trains with.

    Use it as a context manager, or call :meth:`close`, so the process groups are destroyed on
    every exit path.

    Attributes:
        info: rank, local rank, world size and node rank.
        backend: ``"gloo"`` or ``"nccl"``; ``None`` for a single process without a process group.
        device: the device this rank computes on (``cuda:<local_rank>`` with nccl, else CPU).
        process_group: the training group (train timeout); ``None`` at world size 1.
        train_timeout_s: limit for one collective, in seconds.
        debug_collectives: compare shapes and dtypes across ranks before each ddpkit collective
            (see :mod:`ddpkit.runtime.collectives`; also ``DDPKIT_DEBUG_COLLECTIVES=1``).
        watchdog: the deadlock and stall detector (:mod:`ddpkit.watchdog.monitor`), or
            ``None`` (off, or a single process).
        stop: the stop signals' handlers and the ranks' agreement
            (:class:`~ddpkit.runtime.stop.StopRequest`), or ``None`` (off).
        str_hashes_agree: whether ``hash(str)`` is the same on every rank (one
            ``PYTHONHASHSEED``), compared at the rendezvous; when ``False``, anything ordered by
            ``set()`` or string hashes differs per rank (:mod:`ddpkit.runtime.hashseed`).
            ``True`` at world size 1.
        live: this worker's membership of a live fault-tolerant job
            (:class:`~ddpkit.live.membership.LiveMembership`), or ``None``. Its quorum changes
            ``info`` (rank, world size) and ``process_group`` between operations.
        step_probe: the per-step figures of a loop ddpkit does not run
            (:class:`~ddpkit.monitoring.stragglers.LoopProbe`, attached by
            :func:`~ddpkit.wrap_model` to a DDP model), advanced by :meth:`stop_requested`;
            ``None`` when there is none or :class:`~ddpkit.TrainStep` took over.

    Built by :func:`init_runtime`. ``Runtime(ProcessInfo())`` is one CPU process without a
    process group (for tests and tools); every field after ``info`` is keyword-only.
    """

    info: ProcessInfo
    _: KW_ONLY
    backend: str | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    process_group: Any = None
    train_timeout_s: float = TRAIN_TIMEOUT_S
    debug_collectives: bool = False
    watchdog: Watchdog | None = None
    stop: StopRequest | None = None
    str_hashes_agree: bool = True
    live: LiveMembership | None = None
    step_probe: Any = None
    _closed: bool = field(default=False, repr=False)

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def local_rank(self) -> int:
        return self.info.local_rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def is_rank_zero(self) -> bool:
        return self.info.is_rank_zero

    def stop_requested(self) -> bool:
        """Whether every rank agreed to stop, after a stop signal reached any of them.

        Call it once per step, on every rank: it returns the same answer on every rank at the
        same call, ``True`` from the call that first sees a rank's signal on. The ranks compare
        their requests in one small all-reduce every K calls, K set so that the checks cost
        at most 1 % of the time between calls and come at most 1 s apart (see
        :mod:`ddpkit.runtime.stop`). The first call also makes signals wait for this
        agreement (before it they have their usual effect). :meth:`CheckpointManager.maybe_save
        <ddpkit.CheckpointManager.maybe_save>` calls it, saves and raises
        :class:`~ddpkit.TrainingStopped`. With a model of :func:`~ddpkit.wrap_model` in a loop
        without :class:`~ddpkit.TrainStep`, each call also ends a step of the straggler
        detector (:class:`~ddpkit.monitoring.stragglers.LoopProbe`: one all-reduce every 20).

        Collective: call on every rank the same number of times. At world size 1 it answers
        from this process's own signals, without communication. ``False`` always when the
        runtime has no stop signals (``init_runtime(stop_signals=())``).

        Raises:
            DistributedError: a peer stopped answering during the check.

        Example:
            >>> for x, y in loader:
            ...     loss = F.cross_entropy(model(x), y)  # ... one training step
            ...     if rt.stop_requested():  # a stop signal reached some rank: all stop here
            ...         break
        """
        if self.step_probe is not None:  # a step ended: straggler figures (collective)
            self.step_probe.end_step()
        if self.live is not None:
            if self.stop is None:
                return self.live.stop_requested()
            return self.stop.poll_live(self.live)
        return self.stop.poll(self) if self.stop is not None else False

    @contextlib.contextmanager
    def watch(self, op: str, *, stall_check: bool = True) -> Iterator[None]:
        """Run one collective the ranks must all reach, turning a peer that stops answering
        into an error that says what this rank last knew of it.

        The watchdog needs no marker (it reads the training thread's stack); ``op`` only names
        the block in its reports. ``stall_check=False`` declares a wait that may outlast the
        stall timeout (see :meth:`main_process_first`).

        Raises:
            DistributedError: the collective failed because a peer stopped answering (gloo's
                timeout or a closed connection); the message names the ranks not heard from.
        """
        watched = self.watchdog.watch(op, stall_check=stall_check) if self.watchdog else None
        with watched or _NULL_CONTEXT:
            try:
                yield
            except RuntimeError as exc:
                if not mentions(str(exc)):
                    raise
                raise self._lost_peer_error(op, exc) from exc

    @contextlib.contextmanager
    def main_process_first(self, *, local: bool = False) -> Iterator[None]:
        """Run the body on rank 0 first, then on the other ranks (downloads, caches, datasets).

        Rank 0 (with ``local=True``: local rank 0 of each node, for a cache on each node's own
        disk) runs the body while the others wait at a barrier; then the others run it, e.g.
        finding the files rank 0 downloaded. The wait is declared to the watchdog: however long
        rank 0 takes, no stall report (the process group's ``train_timeout_s`` still bounds it).
        A collective inside the body deadlocks (the others are in the barrier) and is reported.

        Collective: call on every rank. At world size 1 it just runs the body.

        Raises:
            DistributedError: a peer stopped answering during the barrier.

        Example:
            >>> with rt.main_process_first():  # rank 0 writes the file, the others find it
            ...     if not os.path.exists("features.pt"):  # e.g. a dataset download
            ...         torch.save(torch.randn(8, 4), "features.pt")
            ...     features = torch.load("features.pt")
        """
        first = self.local_rank == 0 if local else self.rank == 0
        if not first:
            self._main_process_barrier()
        yield  # a body that raises on rank 0 ends its process: the others' barrier then fails
        if first:
            self._main_process_barrier()

    def _main_process_barrier(self) -> None:
        if self.process_group is not None:
            with self.watch("main_process_first barrier", stall_check=False):
                dist.barrier(group=self.process_group)

    def _lost_peer_error(self, op: str, exc: RuntimeError) -> DistributedError:
        detail = str(exc).strip().splitlines()[0].split("] ", 1)[-1]  # drop gloo's [file:line]
        known = (
            self.watchdog.lost_contact()
            if self.watchdog is not None
            else "turn the watchdog on (init_runtime's defaults) to learn which rank went silent"
        )
        if mentions(detail, PEER_ENDED):
            from ddpkit.watchdog.position import collective_in_traceback

            mine = collective_in_traceback(exc) or op
            return DistributedError(
                f"{op} failed on rank {self.rank}/{self.world_size}: {TOLD_ENDED} "
                f"during it ({detail}). It raised, crashed or was aborted: when gloo aborts a "
                "rank with 'Is there a distributed collective mismatch in your code?', the ranks "
                f"called different collectives or passed different sizes (this rank: {mine}). "
                "The first failure in the other ranks' output is the cause."
            )
        return DistributedError(
            f"{op} failed on rank {self.rank}/{self.world_size}: {TOLD_SILENT} "
            f"({detail}). {known[0].upper()}{known[1:]}. A peer died or hung, or the network "
            "between nodes went down; see the other ranks' output."
        )

    def adopt_quorum(self, quorum: Quorum) -> None:
        """Live fault tolerance: take the rank and world size of ``quorum`` (its default group
        is the training group; ``None`` when this member is alone). Not a collective."""
        assert self.live is not None
        size, old = len(quorum.members), self.info
        self.info = dataclasses.replace(
            old,
            rank=quorum.rank_of(self.live.replica),
            world_size=size,
            local_world_size=max(size, 1),
            local_rank=min(old.local_rank, size - 1),
        )
        follow_rank_change(old, self.info)
        self.process_group = dist.group.WORLD if size > 1 else None

    def check_open(self, op: str) -> None:
        """Raise unless the runtime is open: a collective after :meth:`close` would otherwise
        return this rank's own value (world size 1's answer) as if it were the job's.

        Raises:
            DistributedError: the runtime was closed (its ``with`` block ended, or ``close()``).
        """
        if self._closed:
            raise DistributedError(
                f"{op} after the runtime closed: rank={self.rank}, world_size={self.world_size}. "
                "The process group is gone, so no rank would take part and the result would be "
                "this rank's own value. Call collectives inside the `with ddpkit.init_runtime() "
                "as rt:` block, before rt.close()."
            )

    def close(self) -> None:
        """Destroy every process group this process created. Idempotent; safe on error paths.

        Not a collective: each rank tears down its own side. (``ddpkit run``'s worker bootstrap
        also destroys any group a script left alive before the process exits.)
        """
        if self._closed:
            return
        self._closed = True
        if self.stop is not None:
            self.stop.restore()
        if self.watchdog is not None:
            self.watchdog.close()
        if self.live is not None:
            self.live.close()
        self.process_group = None
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, TrainingStopped):
            _report_stop(exc, self)
        if (
            exc is not None
            and not isinstance(exc, TrainingStopped)
            and not isinstance(exc, LeftTheJob)  # live: left on its own signal
        ):  # before the teardown that makes the peers fail
            from ddpkit.diagnostics.translate import add_hint_note

            if self.watchdog is not None:  # a report ends this process: not a second cause
                self.watchdog.wait_if_ending()
            stamp_failure_time(exc)
            add_hint_note(exc)  # the fix under the traceback, under torchrun too
        self.close()


def _report_stop(stopped: TrainingStopped, runtime: Runtime) -> None:
    """Under ``ddpkit run``: the stop record for the launcher's line, written now, before the
    teardown (a late signal may end the process after it); else rank 0 says it."""
    if os.environ.get(RUN_DIR_ENV):
        write_stop_record(stopped, os.environ[RUN_DIR_ENV])
        stopped.recorded = True
    elif runtime.is_rank_zero:
        end = "the newest complete checkpoint stands" if stopped.now else "rerun to resume"
        print(f"ddpkit: {stopped}; {end}.", file=sys.stderr, flush=True)


_NULL_CONTEXT = contextlib.nullcontext()


def _check_timeouts(**timeouts_s: float | None) -> None:
    problems = [
        f"{name}={value!r} must be a positive number of seconds"
        for name, value in timeouts_s.items()
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0
    ]
    if problems:
        raise ConfigError(f"invalid timeout: {'; '.join(problems)}. Pass e.g. 300.")


def _watchdog_timeout(name: str, value: float | None, example: float) -> float | None:
    """``None`` for off (``0`` or ``None``), else the value, checked."""
    if value is None or (value == 0 and not isinstance(value, bool)):
        return None
    _check_timeouts(**{name: value})
    rule = watchdog_timeout_rule(value)
    if rule:
        raise ConfigError(f"invalid timeout: {name}={value!r} {rule}. Pass e.g. {example}.")
    return float(value)


def init_runtime(
    backend: str = "auto",
    *,
    init_timeout_s: float = INIT_TIMEOUT_S,
    train_timeout_s: float = TRAIN_TIMEOUT_S,
    info: ProcessInfo | None = None,
    store: dist.Store | None = None,
    stall_timeout_s: float | None = STALL_TIMEOUT_S,
    deadlock_timeout_s: float | None = 5.0,
    stop_signals: Sequence[int] | None = None,
    fault_tolerance: str | None = None,
) -> Runtime:
    """Join the job: create the process groups and pick this rank's device.

    At world size 1 no process group is created and every ddpkit collective is a local no-op, so
    the same script runs as a plain ``python train.py``.

    The rendezvous also compares ``hash(str)`` across ranks (:mod:`ddpkit.runtime.hashseed`):
    when ``PYTHONHASHSEED`` is unset or differs (plain torchrun, srun), rank 0 logs one warning
    and :attr:`Runtime.str_hashes_agree` is ``False`` on every rank.

    Collective: call on every rank (it is the rendezvous).

    Args:
        backend: ``auto``, ``gloo`` or ``nccl`` (see :func:`resolve_backend`).
        init_timeout_s: how long to wait for every rank to join, in seconds.
        train_timeout_s: how long one training collective may wait, in seconds.
        info: the process coordinates; read from the environment when omitted.
        store: a rendezvous store to use instead of ``MASTER_ADDR``/``MASTER_PORT`` (e.g. a
            ``torch.distributed.FileStore`` shared by the ranks, as ddpkit's test harness does).
        stall_timeout_s: the watchdog (:mod:`ddpkit.watchdog.monitor`, on by default)
            ends the job with a report when a rank has waited in a collective this many seconds
            while another rank runs other code: it names the busy rank and shows its stack.
            ``0`` or ``None``: no stall reports.
        deadlock_timeout_s: the watchdog ends the job with a report naming each rank's
            collective and source line once every rank has been stuck this many seconds in
            collectives that cannot match (different operation, group or count). ``0`` or
            ``None``: no deadlock reports. Both off: no watchdog thread.
        stop_signals: signals that ask every rank to stop at the same step
            (:meth:`Runtime.stop_requested`; :meth:`ddpkit.CheckpointManager.maybe_save`
            saves there). ``None``: the launcher's ``--stop-signals``, else SIGTERM, SIGINT and
            SIGUSR1; ``()``: none. Handlers are installed in the main thread only, and the
            previous ones restored by :meth:`Runtime.close`.
        fault_tolerance: ``"restart"`` (a lost rank ends the job; the launcher may restart
            every rank, which resume from the newest checkpoint) or ``"live"`` (the survivors
            keep training and a replacement heals from them; needs ``ddpkit run
            --fault-tolerance live``, see :mod:`ddpkit.live`). ``None``: what the launcher
            says (``DDPKIT_FAULT_TOLERANCE``), else ``"restart"``. Live has no watchdog: a
            collective there times out after ``min(train_timeout_s, stall_timeout_s)``, and a
            member that hung is then ended by the launcher.

    Returns:
        A :class:`Runtime`; close it (or use ``with``) to destroy the groups.

    Raises:
        ConfigError: bad backend or timeouts; ``MASTER_ADDR``/``MASTER_PORT`` unset where
            Slurm does not determine them (see ``slurm_rendezvous_defaults`` in
            :mod:`ddpkit.env`);
            ``MASTER_PORT`` already in use on rank 0; a non-loopback ``MASTER_ADDR`` for a
            single-node job; a world size above ``DDPKIT_MAX_WORLD_SIZE``; a bad job token
            setting (:func:`ddpkit.security.token.load_token`).
        DistributedError: a process group already exists (call this once per process); the
            loopback interface is down (:func:`~ddpkit.runtime.rendezvous.check_local_route`);
            the store at ``MASTER_ADDR:MASTER_PORT`` is unreachable; two processes claim one rank;
            not every rank joined within ``init_timeout_s`` (the message lists the missing ones);
            this process's world size or job token does not match the job's.

    Example:
        >>> with init_runtime() as rt:  # plain `python train.py`: world size 1
        ...     print(rt.rank, rt.world_size, rt.process_group)
        0 1 None
    """
    _check_timeouts(init_timeout_s=init_timeout_s, train_timeout_s=train_timeout_s)
    live = wants_live(fault_tolerance)
    stall_timeout_s = _watchdog_timeout("stall_timeout_s", stall_timeout_s, 300)
    deadlock_timeout_s = _watchdog_timeout("deadlock_timeout_s", deadlock_timeout_s, 5)
    info = info or detect_process_info()
    check_world_size_limit(info)
    chosen = resolve_backend(backend, info)
    device = torch.device("cuda", info.local_rank) if chosen == "nccl" else torch.device("cpu")
    signals = default_stop_signals() if stop_signals is None else tuple(stop_signals)
    stop = StopRequest(signals)  # a bad signal: an error now, before the rendezvous
    if live:
        cap = min(train_timeout_s, stall_timeout_s or train_timeout_s)  # no watchdog in live
        return start_live(info, chosen, device, init_timeout_s, cap, stop)
    if not info.is_distributed:
        runtime = Runtime(info, device=device, train_timeout_s=float(train_timeout_s))
        runtime.stop = stop if stop.install() else None
        return runtime
    if dist.is_initialized():
        raise DistributedError(
            "init_runtime: a default process group already exists. Call init_runtime once per "
            "process, or destroy the existing group first (dist.destroy_process_group())."
        )
    if store is None:
        _check_master_address(info)
    store, hashes_agree = _rendezvous(info, store, init_timeout_s, chosen=chosen, device=device)
    group = _process_groups(info, store, chosen, device, init_timeout_s, train_timeout_s)
    try:
        watchdog = _start_watchdog(store, info, group, stall_timeout_s, deadlock_timeout_s)
    except BaseException:
        dist.destroy_process_group()
        raise
    runtime = Runtime(
        info,
        backend=chosen,
        device=device,
        process_group=group,
        train_timeout_s=float(train_timeout_s),
        str_hashes_agree=hashes_agree,
    )
    warn_if_str_hashes_differ(info, hashes_agree)
    runtime.watchdog = watchdog
    runtime.stop = stop if stop.install() else None
    return runtime


def _process_groups(
    info: ProcessInfo,
    store: dist.Store,
    backend: str,
    device: torch.device,
    init_timeout_s: float,
    train_timeout_s: float,
) -> dist.ProcessGroup:
    """The default group (init timeout) and the training group (train timeout); returns the
    training group once every rank is connected to it."""
    dist.init_process_group(
        backend=backend,
        rank=info.rank,
        world_size=info.world_size,
        timeout=datetime.timedelta(seconds=init_timeout_s),
        device_id=device if backend == "nccl" else None,
        store=store,
    )
    try:
        group = dist.new_group(timeout=datetime.timedelta(seconds=train_timeout_s))
        # gloo's connectFullMesh can return on one rank while a peer still reads the handshake:
        # a rank that closed the runtime at once then failed that peer with "Connection closed
        # by peer" (3% of 2-rank runs under load). Past this barrier no rank is still connecting.
        dist.barrier(group=group)
    except BaseException:
        dist.destroy_process_group()
        raise
    return group


def start_live(
    info: ProcessInfo,
    backend: str,
    device: torch.device,
    init_timeout_s: float,
    train_timeout_s: float,
    stop: StopRequest,
) -> Runtime:
    """A runtime in a live fault-tolerant job (see :mod:`ddpkit.live`): its rank, world size
    and process group follow the job's quorums; no watchdog (the launcher detects dead and
    hung workers). A replacement starts alone (world size 1, no group) until
    ``CheckpointManager.resume`` heals it into the job. ``stop``'s signals, received by this
    process alone, make it leave the job (its peers go on)."""
    membership = join_live(info, backend, device, init_timeout_s, train_timeout_s)
    runtime = Runtime(
        dataclasses.replace(info, rank=0, world_size=1, local_world_size=1, local_rank=0),
        backend=backend,
        device=device,
        train_timeout_s=float(train_timeout_s),
        live=membership,
    )
    membership.on_change.insert(0, runtime.adopt_quorum)
    if membership.quorum is not None:
        runtime.adopt_quorum(membership.quorum)
    runtime.stop = stop if stop.install() else None
    if runtime.stop is not None:
        membership.leave_signal = runtime.stop.received_name
    return runtime


def _check_master_address(info: ProcessInfo) -> None:
    """``MASTER_ADDR``/``MASTER_PORT`` set, or filled from Slurm's variables under srun.

    Raises:
        ConfigError: one of them is unset and cannot be derived; says what to export.
    """
    os.environ.update(slurm_rendezvous_defaults(info))  # read by make_store and torch alike
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if not missing:
        return
    fix = "Start with torchrun/ddpkit run, or export rank 0's MASTER_ADDR and MASTER_PORT."
    if info.source == "slurm":
        fix = (
            "Under srun, export MASTER_PORT (a port free on the first node) and, on several "
            'nodes, MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1); '
            "or let Slurm reserve a port per step (MpiParams=ports=12000-12999 in slurm.conf)."
        )
    raise ConfigError(
        f"cannot rendezvous: {', '.join(missing)} not set (launcher={info.source}). {fix}"
    )


def _rendezvous(
    info: ProcessInfo,
    store: dist.Store | None,
    init_timeout_s: float,
    *,
    chosen: str,
    device: torch.device,
) -> tuple[dist.Store, bool]:
    """The job's store, once every rank has joined it (names missing/duplicate ranks, checks
    the job token), and whether the ranks' string hashes agree; also turns on faulthandler and
    selects the CUDA device for nccl."""
    token = load_token()
    if not faulthandler.is_enabled():  # a native abort (gloo's, NCCL's) still shows the stack
        faulthandler.enable(all_threads=True)
    if chosen == "nccl":
        torch.cuda.set_device(device)
    if store is None:
        check_local_route(os.environ["MASTER_ADDR"])  # lo down: say so now, not after the timeout
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = (round_store if agent_store else make_store)(info, init_timeout_s)
    return store, join(store, info, init_timeout_s, token)


def _start_watchdog(
    store: dist.Store,
    info: ProcessInfo,
    group: dist.ProcessGroup,
    stall_timeout_s: float | None,
    deadlock_timeout_s: float | None,
) -> Watchdog | None:
    """The watchdog over the default and the training group (``None`` when both are off)."""
    if stall_timeout_s is None and deadlock_timeout_s is None:
        return None
    world = dist.group.WORLD
    assert world is not None  # _process_groups made the default group
    return Watchdog(
        store,
        info,
        stall_timeout_s,
        deadlock_timeout_s=deadlock_timeout_s,
        groups=(group,),
        group_labels={
            world.group_name: "the default group",
            group.group_name: "ddpkit's training group",
        },
        recorder=record_failure,
    ).start()
