"""Hand a script to ``torch.distributed.run`` (torchrun) on this node, and report failures plainly.

What ddpkit adds over calling torchrun yourself:

- a c10d rendezvous whose store ddpkit itself hosts, listening on 127.0.0.1 only, on a port the
  OS picks (torchrun's own stores listen on every interface); workers find their rank-0 store
  at 127.0.0.1 and gloo binds the loopback interface (``GLOO_SOCKET_IFNAME=lo``), so nothing
  outside this machine can reach any of the job's ports;
- ``OMP_NUM_THREADS`` set to the usable cores divided by the number of processes (when unset);
- one ``PYTHONHASHSEED`` for every worker of the job, derived from ``--rdzv-id`` (when
  unset; :mod:`ddpkit.runtime.hashseed`), so ``set()`` of strings has one order on every rank;
- every worker runs under :mod:`ddpkit.launch.worker`, which records the first failure and shuts
  the process group down so the job never aborts at exit;
- a closing summary that names the rank that failed *first*, with its exception type and message.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddpkit.diagnostics.failures import (
    LAUNCHER_PID_ENV,
    RUN_DIR_ENV,
    done_ranks,
    newest_checkpoint,
    read_records,
)
from ddpkit.env import ProcessInfo
from ddpkit.launch.elastic import (
    ELASTIC_ENV,
    announce_restarts,
    parse_rdzv_conf,
    quiet_restarts,
    rendezvous_error_line,
)
from ddpkit.launch.network import (
    NetworkPlan,
    host_rendezvous_store,
    plan_network,
    tls_environment,
)
from ddpkit.launch.oom import OomWatch
from ddpkit.launch.resources import check_fits, usable_cores
from ddpkit.launch.spec import LaunchSpec, validate_spec
from ddpkit.launch.stderr_tail import read_tail, tail_path
from ddpkit.launch.stopping import (
    blocked_while_workers_start,
    kept_checkpoint,
    raising_on_signals,
    resume_part,
    signals_to_handle,
    stop_line,
    stopped_by_workers,
)
from ddpkit.launch.summary import summarize_failure
from ddpkit.runtime.hashseed import hash_seed_environment
from ddpkit.runtime.rendezvous import check_local_route, check_world_size_limit
from ddpkit.runtime.stop import GRACE_PERIOD_ENV, STOP_SIGNALS_ENV
from ddpkit.security.bind import MASTER_PORT_ENV, MULTI_NODE_ENV, reserve_port
from ddpkit.security.rendezvous_state import (
    BACKEND_NAME,
    RendezvousStateRefused,
    rendezvous_key,
    signed_rendezvous,
)
from ddpkit.security.token import load_token

WORKER_MODULE = "ddpkit.launch.worker"
AGENT_STORE_TIMEOUT_S = 10
AGENT_STUCK_S = 2 * AGENT_STORE_TIMEOUT_S


def torchrun_argv(
    spec: LaunchSpec,
    plan: NetworkPlan,
    run_id: str,
    backend: str = BACKEND_NAME,
    *,
    log_dir: str | None = None,
) -> list[str]:
    """The ``torch.distributed.run`` command line for ``spec`` (without the program name).

    The rendezvous store at the plan's endpoint is one a ddpkit launcher already hosts (node
    0's, listening on one address only): torchrun's agent only connects to it
    (``is_host=false``), and advertises ``plan.local_address`` to the workers. ``backend``:
    ddpkit's signed c10d rendezvous (:mod:`ddpkit.security.rendezvous_state`). ``log_dir``:
    torchrun's ``--log-dir`` (its per-rank ``error.json`` files); ``None``: torchrun makes a
    ``torchelastic_*`` folder in ``$TMPDIR`` and leaves it there.
    """
    # is_host=false: the store is ours, torchrun only connects. read_timeout bounds each of the
    # agent's store calls (torch's default, 60 s, kept a node whose link went down waiting
    # minutes after its workers had failed).
    conf = {"is_host": "false", "read_timeout": AGENT_STORE_TIMEOUT_S}
    conf.update(parse_rdzv_conf(spec.rdzv_conf)[0])
    return [
        f"--nnodes={spec.nnodes_arg}",
        f"--rdzv-backend={backend}",
        f"--rdzv-endpoint={plan.endpoint_host}:{plan.endpoint_port}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf={','.join(f'{key}={value}' for key, value in conf.items())}",
        f"--local-addr={plan.local_address}",
        f"--nproc-per-node={spec.nproc}",
        f"--max-restarts={spec.max_restarts}",
        "--monitor-interval=0.1",
        *([f"--log-dir={log_dir}"] if log_dir else []),
        # torchrun passes these on to every worker, and SIGKILLs them after the grace period
        f"--signals-to-handle={signals_to_handle(spec.stop_signals)}",
        f"--shutdown-timeout={spec.grace_period_s}",
        "--module",
        "--",  # the rest is ours: torchrun's parser must not read "--nproc 2" as its own option
        WORKER_MODULE,
        *spec.target,
    ]


def launch(spec: LaunchSpec) -> int:
    """Start ``spec.nproc`` workers through torchrun and wait for them.

    Returns:
        0 when every worker exited 0; 1 when one failed (after the summary is printed to
        stderr); 128 + the signal number after a stop signal reached the launcher or a worker
        (SIGTERM: 143, SIGUSR1: 138, Ctrl-C: 130), after one line saying where the job
        stopped, what checkpoint it left and the command that resumes it
        (:mod:`ddpkit.launch.stopping`).

    Raises:
        ConfigError: an invalid :class:`LaunchSpec`; more ranks than fit in the available
            memory; a bad job token setting or a world size above ``DDPKIT_MAX_WORLD_SIZE``;
            an address this node cannot use.
        DistributedError: this node cannot connect to its own address (the loopback
            interface is down).

    Every folder the launch creates in ``$TMPDIR`` (its run folder, torchrun's log folder
    inside it) is removed when it ends: success, failure, a stop signal, a killed worker.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException

    # torchrun turns its signals into SignalException only once its workers start; before that
    # (checks, rendezvous) their default action would end the launcher past its finally blocks
    with raising_on_signals(signals_to_handle(spec.stop_signals)):
        run_dir = tempfile.mkdtemp(prefix="ddpkit-run-")
        try:
            return _launch_in(spec, _preflight(spec), run_dir)
        except SignalException as exc:  # before torchrun's agent ran
            return _stopped(spec, run_dir, exc.sigval)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)


def _launch_in(spec: LaunchSpec, plan: NetworkPlan, run_dir: str) -> int:
    """:func:`launch` with its checks done and its run folder made."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    tls_env = tls_environment(spec)
    saved = dict(os.environ)
    rdzv_store = None
    if plan.store_address is not None:
        rdzv_store = host_rendezvous_store(plan.store_address, plan.endpoint_port)
        plan = dataclasses.replace(plan, endpoint_port=rdzv_store.port)
    run_id = _run_id(spec)
    os.environ.update({**_worker_environment(spec, plan, run_dir), **tls_env})
    reserved = _reserve_master_port(spec, plan)
    if spec.nnodes > 1 and spec.max_restarts == 0:
        threading.Thread(
            target=_stop_if_agent_stuck,
            args=(run_dir, spec),
            name="ddpkit-agent-guard",
            daemon=True,
        ).start()
    quiet = _QuietStop(spec.stop_signals)
    for name in _TORCHRUN_LOGGERS:
        logging.getLogger(name).addFilter(quiet)
    agent_logger, announcer = announce_restarts(spec.command, elastic=spec.elastic)
    oom_watch = OomWatch.start()  # did the kernel kill a rank for memory? (a SIGKILL's hint)
    try:
        _run_agent(torchrun, spec, plan, run_id, run_dir)
        return _stopped(spec, run_dir, None) if stopped_by_workers(run_dir) else 0
    except ChildFailedError as exc:
        _print_failure_summary(spec, run_dir, exc.failures, oom_watch)
        return 1
    except RendezvousStateRefused as exc:  # someone else wrote the state: its workers stopped
        print(f"ddpkit run: {exc}", file=sys.stderr)
        return 1
    except RendezvousError as exc:  # this node's agent could not (re)join (several nodes)
        endpoint = f"{plan.endpoint_host}:{plan.endpoint_port}"
        joined = announcer.rendezvous_done > 0
        line = rendezvous_error_line(
            spec, endpoint, exc, read_records(run_dir), joined_before=joined
        )
        print(line, file=sys.stderr)
        return 1
    except SignalException as exc:  # SIGTERM, SIGINT, ... to the launcher: the workers stopped
        return _stopped(spec, run_dir, exc.sigval)
    except KeyboardInterrupt:  # Ctrl-C before torchrun took the signals over
        return _stopped(spec, run_dir, signal.SIGINT)
    finally:
        quiet_restarts(agent_logger, announcer)
        for name in _TORCHRUN_LOGGERS:
            logging.getLogger(name).removeFilter(quiet)
        os.environ.clear()
        os.environ.update(saved)
        del rdzv_store
        if reserved is not None:
            reserved.close()


def _run_agent(
    torchrun: Any, spec: LaunchSpec, plan: NetworkPlan, run_id: str, run_dir: str
) -> None:
    """This node's torchrun agent (``torch.distributed.run``), until its workers end, with
    ddpkit's signed rendezvous backend (:mod:`ddpkit.security.rendezvous_state`); its log
    folder is inside ``run_dir``."""
    key = rendezvous_key(load_token(), several_nodes=spec.nnodes > 1)
    with signed_rendezvous(key) as backend:
        argv = torchrun_argv(spec, plan, run_id, backend, log_dir=os.path.join(run_dir, "torch"))
        with blocked_while_workers_start(spec.stop_signals):
            torchrun.run(torchrun.parse_args(argv))


def _reserve_master_port(spec: LaunchSpec, plan: NetworkPlan) -> socket.socket | None:
    """One node: rank 0's store port, held by the launcher for the whole run and exported as
    ``DDPKIT_MASTER_PORT`` (torchrun's agent picks one by binding port 0 and closing it, and
    anything may take it before rank 0 listens). Several nodes: ``None``, torchrun's pick, and
    no value inherited from an enclosing job."""
    os.environ.pop(MASTER_PORT_ENV, None)
    if spec.nnodes > 1:  # rank 0 may be on any node
        return None
    reserved = reserve_port(plan.local_address)
    os.environ[MASTER_PORT_ENV] = str(reserved.getsockname()[1])
    return reserved


def _preflight(spec: LaunchSpec) -> NetworkPlan:
    """Every check a worker would fail, done once before anything starts; the network plan."""
    validate_spec(spec)
    warning = check_fits(
        spec.nproc, mem_per_rank_mib=spec.mem_per_rank_mib, what=spec.mem_per_rank_what
    )
    if warning:  # more processes than cores: allowed (tests do it), said once
        print(f"{spec.command}: {warning}", file=sys.stderr, flush=True)
    load_token()
    check_world_size_limit(ProcessInfo(world_size=spec.world_size))
    plan = plan_network(spec)
    check_local_route(plan.local_address)  # lo down: one line now, not 300 s of store retries
    return plan


def _kept_after_failure(spec: LaunchSpec, run_dir: str, records: Sequence[Any] = ()) -> str:
    """The failure line's end: the newest complete checkpoint and how to resume from it;
    nothing when the first failure is a refused setting or file (the resume would fail too)."""
    if records and records[0].type in ("ConfigError", "DataError"):
        return ""
    if spec.on_interrupt is not None:  # ddpkit train: its own checkpoint folder and command
        return spec.on_interrupt(saved=False)
    newest = newest_checkpoint(run_dir)
    if newest is None:
        return ""
    return f"{kept_checkpoint(newest, saved=False)}{resume_part(spec)}"


def _print_failure_summary(
    spec: LaunchSpec, run_dir: str, failures: dict[int, Any], oom_watch: OomWatch
) -> None:
    """The summary of the last attempt's failure records (first failure first), on stderr.

    ``failures``: torchrun's rank -> ``ProcessFailure`` (its ``exitcode`` and ``pid``).
    """
    exit_codes = {rank: failure.exitcode for rank, failure in failures.items()}
    records = read_records(run_dir)
    attempt = max((r.restart for r in records), default=0)
    records = [r for r in records if r.restart == attempt]
    tails = _stderr_tails(run_dir, exit_codes)
    finished = done_ranks(run_dir, attempt)
    pids = {rank: failure.pid for rank, failure in failures.items()}
    hints = oom_watch.hints(exit_codes, pids, spec.nproc, spec.command)
    for line in summarize_failure(
        records,
        exit_codes,
        spec,
        tails,
        finished=finished,
        kill_hints=hints,
        kept=_kept_after_failure(spec, run_dir, records),
    ):
        print(line, file=sys.stderr)


class _QuietStop(logging.Filter):
    """Drops torchrun's own warnings about a stop signal ("Received 15 death signal", then
    "Sending process N closing signal SIGTERM", one per worker): the launcher says it in one
    line. Also the rendezvous's "failed to shutdown" warning after a refused state (the
    launcher's line says why). Other warnings (a worker SIGKILLed at the end of the grace
    period) stay."""

    def __init__(self, stop_signals: tuple[signal.Signals, ...]) -> None:
        super().__init__()
        self.signals = stop_signals
        self.stopping = False

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if RendezvousStateRefused.__name__ in text:
            return False
        for sig in self.signals:
            if f"Received {int(sig)} death signal" in text or f"Received {sig.name} death" in text:
                self.stopping = True
                return False
        return not (self.stopping and "closing signal" in text)


_TORCHRUN_LOGGERS = (
    "torch.distributed.elastic.agent.server.api",
    "torch.distributed.elastic.multiprocessing.api",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
)


def _stopped(spec: LaunchSpec, run_dir: str, received: signal.Signals | None) -> int:
    """A stop signal: one line for the whole job, after every worker has stopped; returns 128 +
    the signal number (see :func:`ddpkit.launch.stopping.stop_line`)."""
    line, code = stop_line(spec, run_dir, received)
    print(line, file=sys.stderr, flush=True)
    return code


def _stderr_tails(run_dir: str, exit_codes: dict[int, int]) -> dict[int, str]:
    """rank -> the last bytes of its stderr, for the ranks that died from a signal (their
    copiers finish within moments of the worker; waited for up to 2 s in all)."""
    deadline = time.monotonic() + 2.0
    tails = {}
    for rank in (rank for rank, code in exit_codes.items() if code < 0):
        paths = sorted(Path(run_dir).glob(f"stderr-r*-rank{rank}.txt"))
        latest = paths[-1] if paths else tail_path(run_dir, 0, rank)
        tails[rank] = read_tail(latest, wait_s=max(0.0, deadline - time.monotonic()))
    return tails


def _run_id(spec: LaunchSpec) -> str:
    """The rendezvous run id: a new one per job on one node; several nodes: ``--rdzv-id``, the
    one name every node's launcher is given."""
    return uuid.uuid4().hex if spec.nnodes == 1 else spec.rdzv_id


def _worker_environment(spec: LaunchSpec, plan: NetworkPlan, run_dir: str) -> dict[str, str]:
    """Variables every worker inherits: where the stores and gloo bind, threads, bookkeeping,
    and one hash seed (from ``--rdzv-id``, the same on every node and for every submission of
    the job, so a resumed job orders its strings as the checkpointed one did; kept when
    ``PYTHONHASHSEED`` is set).

    No shared agent store (torchrun's listens on every interface): rank 0 serves the job's
    store on its node's address only (ddpkit's ``make_store``), and gloo binds that interface.
    """
    env = {
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "GLOO_SOCKET_IFNAME": plan.ifname,
        RUN_DIR_ENV: run_dir,
        LAUNCHER_PID_ENV: str(os.getpid()),
        GRACE_PERIOD_ENV: str(spec.grace_period_s),
        STOP_SIGNALS_ENV: ",".join(s.name for s in spec.stop_signals) or "none",
        "OMP_NUM_THREADS": os.environ.get(
            "OMP_NUM_THREADS", str(max(1, usable_cores() // spec.nproc))
        ),
        **hash_seed_environment(spec.rdzv_id),
    }
    if spec.omp_num_threads is not None:
        env["OMP_NUM_THREADS"] = str(spec.omp_num_threads)
    if spec.nnodes > 1:
        env[MULTI_NODE_ENV] = "1"
    if spec.elastic:
        env[ELASTIC_ENV] = "1"
    return env


def _stop_if_agent_stuck(run_dir: str, spec: LaunchSpec, poll_s: float = 0.5) -> None:
    """End this launcher when a worker has failed but torchrun's agent does not return.

    On several nodes the agent keeps polling the rendezvous store on node 0; when the link to
    node 0 is down, each call waits out its timeout and is retried, so the agent never reports
    the failure its worker already recorded. After ``AGENT_STUCK_S`` the launcher prints the
    summary and exits 1; its workers die with it (``PR_SET_PDEATHSIG``). Armed only without
    restarts, where a failure is always final.
    """
    first_seen = None
    while True:
        time.sleep(poll_s)
        records = read_records(run_dir)
        if not records:
            continue
        first_seen = first_seen or time.monotonic()
        if time.monotonic() - first_seen < AGENT_STUCK_S:
            continue
        for line in summarize_failure(records, {}, spec)[:-1]:
            print(line, file=sys.stderr)
        print(
            f"{spec.command}: job FAILED; torchrun's agent did not finish within {AGENT_STUCK_S} s "
            f"of the failure (the rendezvous store at {spec.rdzv_endpoint} does not answer: "
            "node 0 or the network to it is down); this node's processes stopped.",
            file=sys.stderr,
            flush=True,
        )
        shutil.rmtree(run_dir, ignore_errors=True)  # os._exit skips launch()'s finally
        os._exit(1)
