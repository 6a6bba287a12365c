"""``ddpkit run --fault-tolerance live``: the survivors keep training when a worker dies.

torchrun's agent restarts *every* worker when one fails (its worker group is the unit), so live
fault tolerance starts and watches the workers itself, one process each (``subprocess``, the
same worker bootstrap as ``ddpkit run``), and hosts the job's coordination store (a
``TCPStore`` on 127.0.0.1, on a port the OS picks). Its :class:`~ddpkit.live.lighthouse.
Lighthouse` declares the dead and forms quorums; the workers do the rest
(:mod:`ddpkit.live.membership`). A lost worker's slot is refilled by a warm spare (``--spares``:
processes that have already imported torch and ddpkit) or a new process (``--max-restarts``,
default 3 here), which heals from a live peer and joins at the next step.

One node only for now: several nodes need a store every node reaches and a lighthouse per job,
not per node (not built; ``--nnodes`` is refused with live).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field

from ddpkit.diagnostics.failures import read_records, read_stop_records, take_records
from ddpkit.errors import ConfigError
from ddpkit.launch.launcher import LaunchSpec, _preflight, _stopped, _worker_environment
from ddpkit.launch.network import host_rendezvous_store
from ddpkit.launch.spare import PRELOAD_ENV, SPARE_ENV, slot_environment
from ddpkit.launch.stopping import stopped_by_workers
from ddpkit.launch.summary import summarize_failure
from ddpkit.live.lighthouse import Event, Lighthouse
from ddpkit.live.protocol import STORE_ENV, key
from ddpkit.live.start import MODE_ENV

TICK_S = 0.05


@dataclass
class _Process:
    """A worker or spare process the launcher started."""

    popen: subprocess.Popen
    slot: int  # -1 for a spare not yet activated
    replica: str
    started: float = field(default_factory=time.monotonic)
    exit_code: int | None = None


class WorkerPool:
    """The job's processes: the workers by replica id, the idle warm spares.

    Args:
        spec: the launch; env: every process's environment; store: the coordination store.
    """

    def __init__(self, spec: LaunchSpec, env: dict[str, str], store: object, run_dir: str) -> None:
        self.spec, self.env, self.store, self.run_dir = spec, env, store, run_dir
        self.workers: dict[str, _Process] = {}
        self.spares: dict[str, _Process] = {}
        self.replacements = 0
        self.survived: list[str] = []  # every failure the job went on from, as its line said

    def _popen(self, module: str, extra: dict[str, str]) -> subprocess.Popen:
        env = {**self.env, **extra}
        return subprocess.Popen(
            [sys.executable, "-m", module, *self.spec.target],
            env=env,
            start_new_session=True,  # Ctrl-C reaches the launcher, which stops the job
        )

    def start(self, slot: int, role: str) -> str:
        """Start a worker for ``slot`` (``role``: ``initial`` or ``replacement``); its id."""
        replica = f"s{slot}-{uuid.uuid4().hex}"
        extra = slot_environment(slot, self.spec.nproc, replica, role)
        self.workers[replica] = _Process(self._popen("ddpkit.launch.worker", extra), slot, replica)
        return replica

    def start_spare(self) -> None:
        spare = uuid.uuid4().hex[:12]
        self.spares[spare] = _Process(
            self._popen("ddpkit.launch.spare", {SPARE_ENV: spare}), -1, spare
        )

    def activate_spare(self, slot: int) -> str | None:
        """Hand ``slot`` to an idle spare that is still alive; its new replica id, or ``None``."""
        for spare, proc in list(self.spares.items()):
            del self.spares[spare]
            if proc.popen.poll() is not None:
                continue
            replica = f"s{slot}-{uuid.uuid4().hex}"
            proc.slot, proc.replica = slot, replica
            self.workers[replica] = proc
            record = {"slot": slot, "replica": replica, "nproc": self.spec.nproc}
            self.store.set(key("activate", spare), json.dumps(record))  # type: ignore[attr-defined]
            return replica
        return None

    def take_errors(self, replica: str) -> str:
        """The exception a worker recorded before it died (``Type: message``), its record
        removed: the job survived it, so the final summary must not name it as the failure."""
        proc = self.workers.get(replica)
        if proc is None:
            return ""
        found = take_records(self.run_dir, proc.popen.pid)
        return "; ".join(f"{r.type}: {r.message}"[:200] for r in found)

    def exits(self) -> list[tuple[str, int]]:
        """Workers that ended since the last call: ``(replica, exit code)``."""
        ended = []
        for replica, proc in self.workers.items():
            if proc.exit_code is None and proc.popen.poll() is not None:
                proc.exit_code = proc.popen.returncode
                ended.append((replica, proc.exit_code))
        return ended

    def running(self) -> list[_Process]:
        return [p for p in self.workers.values() if p.popen.poll() is None]

    def kill(self, replica: str) -> None:
        proc = self.workers.get(replica)
        if proc is not None:
            _kill_session(proc.popen)

    def kill_all(self) -> None:
        for proc in [*self.workers.values(), *self.spares.values()]:
            _kill_session(proc.popen)
        for proc in [*self.workers.values(), *self.spares.values()]:
            try:
                proc.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def _kill_session(popen: subprocess.Popen) -> None:
    """SIGKILL a worker and everything it started (its data-loader workers): it leads a
    session of its own, so its process group is its pid."""
    try:
        os.killpg(popen.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def check_live_spec(spec: LaunchSpec) -> None:
    """Raise unless ``spec`` can run with live fault tolerance (its settings alone are
    checked by :func:`~ddpkit.launch.spec.validate_spec`).

    Raises:
        ConfigError: several nodes, or TLS.
    """
    problems = []
    if spec.nnodes > 1 or spec.min_nodes not in (None, spec.nnodes):
        problems.append("--nnodes above 1 (live fault tolerance runs on one node for now)")
    if spec.tls is not None:
        problems.append("--tls-* (the live process groups do not take gloo's TLS yet)")
    if problems:
        raise ConfigError(
            f"--fault-tolerance live cannot run with {'; '.join(problems)}. Drop them, or use "
            "--fault-tolerance restart."
        )


def launch_live(spec: LaunchSpec) -> int:
    """Start ``spec.nproc`` workers with live fault tolerance and wait for them.

    Returns:
        0 when the job ran to its end; 1 when no member was left to go on (or a worker failed
        the same way until the replacements ran out); 128 + the signal after a stop signal to
        the launcher (every member stopped at one step with a checkpoint).

    Raises:
        ConfigError: what :func:`check_live_spec` and ``ddpkit run``'s checks refuse.
    """
    check_live_spec(spec)
    plan = _preflight(spec)
    store = host_rendezvous_store(plan.local_address, 0)
    run_dir = tempfile.mkdtemp(prefix="ddpkit-run-")
    env = {
        **os.environ,
        **_worker_environment(spec, plan, run_dir),
        STORE_ENV: f"{plan.local_address}:{store.port}",
        MODE_ENV: "live",
        PRELOAD_ENV: ",".join(spec.preload),
    }
    pool = WorkerPool(spec, env, store, run_dir)
    lighthouse = Lighthouse(store, spec.nproc, heartbeat_timeout_s=spec.heartbeat_timeout_s)
    stop = _StopSignals(spec.stop_signals)
    try:
        for slot in range(spec.nproc):
            lighthouse.add(pool.start(slot, "initial"), slot)
        for _ in range(spec.spares):
            pool.start_spare()
        return _watch(spec, pool, lighthouse, stop, run_dir)
    finally:
        stop.restore()
        pool.kill_all()
        shutil.rmtree(run_dir, ignore_errors=True)
        del store


class _StopSignals:
    """The launcher's stop signals: recorded, acted on in its loop."""

    def __init__(self, signals: tuple[signal.Signals, ...]) -> None:
        self.received: signal.Signals | None = None
        self.count = 0
        self.members = 0  # the members when it arrived (the stop line counts them)
        self._previous = {sig: signal.signal(sig, self._handle) for sig in signals}

    def _handle(self, signum: int, frame: object) -> None:
        self.received = self.received or signal.Signals(signum)
        self.count += 1

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _watch(
    spec: LaunchSpec, pool: WorkerPool, lighthouse: Lighthouse, stop: _StopSignals, run_dir: str
) -> int:
    """The launcher's loop: exits, the lighthouse's events, replacements, stop signals."""
    say = _Say(spec.command)
    stop_deadline = None
    while True:
        running = pool.running()  # before the exits: the last one dying now is seen below
        for replica, code in pool.exits():
            if replica in lighthouse.replicas:
                lighthouse.exited(replica, code)
        for event in lighthouse.tick():
            if event.kind == "empty":
                return _no_member_left(spec, pool, lighthouse, run_dir, event, say)
            _act(event, spec, pool, lighthouse, say, stopping=stop.received is not None)
        if stop.received is not None and stop_deadline is None:
            lighthouse.stop_job(stop.received.name)
            stop_deadline = time.monotonic() + spec.grace_period_s
            stop.members = len(lighthouse.quorum.members) if lighthouse.quorum else spec.nproc
        if stop_deadline is not None and (
            stop.count > 1 or time.monotonic() > stop_deadline
        ):  # a second signal, or the grace period is over: end it now
            pool.kill_all()
        # replacements still waiting to join have no job left
        if lighthouse.all_finished() or not running:
            pool.kill_all()
            return _finish(spec, pool, lighthouse, stop, run_dir, say)
        time.sleep(TICK_S)


class _Say:
    """The launcher's lines, prefixed with the command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __call__(self, text: str) -> None:
        print(f"{self.command}: live: {text}", file=sys.stderr, flush=True)


def _act(
    event: Event,
    spec: LaunchSpec,
    pool: WorkerPool,
    lighthouse: Lighthouse,
    say: _Say,
    *,
    stopping: bool,
) -> None:
    """Say what happened; end a worker declared dead; refill its slot (not once the job is
    stopping on a signal)."""
    if event.kind == "quorum":
        quorum = event.quorum
        assert quorum is not None
        if quorum.number > 1 and not event.quiet:
            slots = [lighthouse.replicas[m].slot for m in quorum.members]
            say(f"quorum {quorum.number}: slots {slots} (world size {len(slots)}); {quorum.reason}")
        return
    if event.kind not in ("dead", "left"):
        return  # a member that finished: nothing to say, nothing to refill
    slot = lighthouse.replicas[event.replica].slot
    if event.kill:
        pool.kill(event.replica)
    line = f"slot {slot} {event.why}" if event.kind == "dead" else f"slot {slot} left ({event.why})"
    say(line)
    errors = pool.take_errors(event.replica)
    pool.survived.append(f"{line} ({errors})" if errors else line)
    if not stopping:
        _refill(slot, spec, pool, lighthouse, say)


def _refill(
    slot: int, spec: LaunchSpec, pool: WorkerPool, lighthouse: Lighthouse, say: _Say
) -> None:
    """A warm spare for ``slot``, else a new process while replacements are left."""
    replica = pool.activate_spare(slot)
    if replica is not None:
        lighthouse.add(replica, slot)
        refilled = pool.replacements < spec.max_restarts  # the pool of spares kept full
        if refilled:
            pool.replacements += 1
            pool.start_spare()
        say(
            f"slot {slot}: a warm spare takes over; it heals from a live peer"
            + (
                f" (a new spare starts: {pool.replacements} of {spec.max_restarts})"
                if refilled
                else ""
            )
        )
        return
    if pool.replacements >= spec.max_restarts:
        if lighthouse.members_alive():
            used = f"all {spec.max_restarts} used" if spec.max_restarts else "--max-restarts 0"
            say(f"slot {slot}: no replacement ({used}); the others go on without it")
        return
    pool.replacements += 1
    lighthouse.add(pool.start(slot, "replacement"), slot)
    say(
        f"slot {slot}: replacement {pool.replacements} of {spec.max_restarts} started; it heals "
        "from a live peer"
    )


def _no_member_left(
    spec: LaunchSpec,
    pool: WorkerPool,
    lighthouse: Lighthouse,
    run_dir: str,
    event: Event,
    say: _Say,
) -> int:
    """Every member is gone: stop what is left, name the failures and the newest checkpoint."""
    pool.kill_all()
    records = read_records(run_dir)
    if records:
        for line in summarize_failure(records, {}, spec)[:-1]:
            print(line, file=sys.stderr)
    newest = lighthouse.newest_checkpoint()
    resume = spec.resume_command or f"{spec.command} ..."
    kept = (
        f"the newest complete checkpoint is {newest}; run `{resume}` again to resume from it"
        if newest
        else "no checkpoint was written"
    )
    say(f"job FAILED: no live member is left to go on ({event.why}); {kept}")
    return 1


def _finish(
    spec: LaunchSpec,
    pool: WorkerPool,
    lighthouse: Lighthouse,
    stop: _StopSignals,
    run_dir: str,
    say: _Say,
) -> int:
    """Every worker ended: the job's outcome, one line."""
    members = lighthouse.quorum.members if lighthouse.quorum else ()
    codes = [pool.workers[m].popen.poll() for m in members if m in pool.workers]
    if stop.received is not None:
        return _stopped(
            dataclasses.replace(spec, nproc=max(stop.members, 1)), run_dir, stop.received
        )
    if codes and all(c == 0 for c in codes):
        if stopped_by_workers(run_dir):  # every member got a stop signal of its own at once
            final = dataclasses.replace(spec, nproc=len(read_stop_records(run_dir)))
            return _stopped(final, run_dir, None)
        if pool.survived:  # a job that lost ranks on the way: say so at the end
            say(f"completed; {len(pool.survived)} failure(s) survived: {'; '.join(pool.survived)}")
        return 0
    records = read_records(run_dir)
    for line in summarize_failure(records, {}, spec)[:-1] if records else []:
        print(line, file=sys.stderr)
    # None: a member kill_all could not reap in time (sorted with the ints, not a TypeError)
    exited = sorted(set(codes), key=lambda code: (code is not None, code or 0))
    say(f"job FAILED: the last members exited with {exited}")
    return 1
