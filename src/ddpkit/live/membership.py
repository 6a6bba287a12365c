"""A worker's side of live fault tolerance: quorums, the process group of each, guarded
operations with an agreed commit, and healing a replacement from a live peer.

Engine: torch's own pieces, as torchft's ``ProcessGroupGloo.configure`` uses them. Each quorum
gets a new default process group (``init_process_group`` on a fresh ``PrefixStore`` of the
launcher's store); the old one is destroyed. Agreement goes through the store's atomic
operations only (:mod:`ddpkit.live.protocol`): every member votes once per operation with
``compare_set``, and every member reads the same final votes.

What a guarded operation is (:meth:`LiveMembership.attempt`): the collectives of one unit of
work (a training step's gradient all-reduce, an evaluation, a checkpoint save). A peer that dies
inside it makes the collectives fail on some members (gloo: "Connection closed by peer"); they
vote ``ok=False``, the dead member's missing vote is found by its peers once the launcher has
declared it dead, and the operation is discarded on every member. A member that had finished
its collectives before the failure discards it too (never commit on one replica and not on
another). Then every member moves to the launcher's newer quorum (:meth:`reconfigure`).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ddpkit.errors import DistributedError
from ddpkit.live.agreement import arrival_outcome, collect_votes
from ddpkit.live.heal import transfer_state
from ddpkit.live.outcomes import (
    Attempt,
    LeftTheJob,
    LiveCounters,
    RefusedError,
    is_lost_peer,
)
from ddpkit.live.protocol import (
    DEAD,
    HEARTBEAT_S,
    Decision,
    Quorum,
    Status,
    Vote,
    decide,
    key,
    slot_of,
)
from ddpkit.live.sockets import new_sockets, shut_down, socket_inodes
from ddpkit.log import get_logger

log = get_logger("live")
REPLACEMENT_WAIT_S = 7 * 24 * 3600.0  # a replacement waits for the members' next step


class LiveMembership:
    """This worker's membership of a live fault-tolerant job.

    Built by :func:`ddpkit.init_runtime` with ``fault_tolerance="live"`` under ``ddpkit run
    --fault-tolerance live``; reached as ``runtime.live``.

    Args:
        store: a client of the launcher's coordination store.
        replica: this worker's replica id.
        heartbeat_store: a second client for the heartbeat thread (``None``: no heartbeat).
        backend: the process groups' backend (``gloo``; ``nccl`` is the same path, untested).
        device: this worker's device (nccl binds its group to it).
        formation_timeout_s: how long building one quorum's group may take once every member
            has arrived (a member that dies inside it costs this much).
        train_timeout_s: the timeout of every collective of a group once formed.
        hang_timeout_s: after this long waiting for a member's vote, report it as hung (the
            launcher then ends it).
    """

    def __init__(
        self,
        store: dist.Store,
        replica: str,
        *,
        heartbeat_store: dist.Store | None = None,
        backend: str = "gloo",
        device: torch.device | None = None,
        formation_timeout_s: float = 60.0,
        train_timeout_s: float = 1800.0,
        hang_timeout_s: float = 60.0,
    ) -> None:
        self.store = store
        self.replica = replica
        self.backend = backend
        self.device = device or torch.device("cpu")
        self.formation_timeout_s = formation_timeout_s
        self.train_timeout_s = train_timeout_s
        self.hang_timeout_s = hang_timeout_s
        self.quorum: Quorum | None = None
        self.seq = 0  # the next operation's number in the current quorum
        self.counters = LiveCounters()
        self.last_decision: Decision | None = None
        self.stop_signal = ""  # the job's agreed stop ("" until the members agree)
        self.admit_pending = False  # replacements wait: take them in before the next step
        self.leave_signal: Callable[[], str] | None = None  # "" or this process's own signal
        self.step = 0  # optimizer steps committed (set by resume, counted by TrainStep)
        self.heal_source: Callable[[], dict[str, Any]] | None = None  # rank 0: the state
        self.heal_local: Callable[[], Any] | None = None  # every member: its RNG states
        self.heal_sink: Callable[[dict[str, Any], list[Any], int], None] | None = None  # load
        self.heal_unsafe_pickle = False  # the CheckpointManager's unsafe_pickle
        self.healed = True  # False for a replacement until a quorum took it in, healed
        self.on_change: list[Callable[[Quorum], None]] = []  # loaders re-shard here
        self._depth = 0  # nesting of guarded operations (only the outermost votes)
        self._group_sockets: dict[int, str] = {}  # the current group's connections
        self._attempt_start = 0.0
        self._beat_stop = threading.Event()
        self._heartbeat_store = heartbeat_store

    # -- registration -------------------------------------------------------------------------

    def register(self, slot: int) -> None:
        """Announce this worker to the launcher and start its heartbeat. Not a collective."""
        record = {"slot": slot, "pid": os.getpid(), "host": socket.gethostname()}
        self.store.set(key("replica", self.replica), json.dumps(record))
        if self._heartbeat_store is not None:
            threading.Thread(target=self._beat, name="ddpkit-live-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        assert self._heartbeat_store is not None
        name = key("hb", self.replica)
        while not self._beat_stop.wait(HEARTBEAT_S):
            try:
                self._heartbeat_store.add(name, 1)
            except Exception:  # noqa: BLE001 - the launcher is gone: the main thread finds out
                return

    def close(self) -> None:
        """Stop the heartbeat. Not a collective."""
        self._beat_stop.set()

    # -- quorums ------------------------------------------------------------------------------

    def latest(self) -> int:
        """The newest quorum's number (0: none yet)."""
        return int(self.store.add(key("quorum", "latest"), 0))

    def status(self) -> Status:
        """The launcher's status record (newest quorum, replacements waiting, stop)."""
        return Status.decode(self.store.get(key("status")))

    def read_quorum(self, number: int) -> Quorum:
        return Quorum.decode(number, self.store.get(key("quorum", number)))

    def _check_not_dead(self) -> None:
        if self.store.check([key("dead", self.replica)]):
            why = self.store.get(key("dead", self.replica)).decode()
            raise RefusedError(
                f"this worker was declared dead by the job ({why}) and may not rejoin: its "
                "peers went on without it. The launcher starts a replacement that heals from "
                "them."
            )

    def wait_for_quorum(self, after: int, timeout_s: float) -> Quorum:
        """The first quorum newer than ``after`` that has this worker as a member.

        Raises:
            RefusedError: the launcher declared this worker dead.
            DistributedError: none within ``timeout_s`` seconds.
        """
        deadline = time.monotonic() + timeout_s
        pause = 0.001
        while True:
            latest = self.latest()
            if latest > after:
                quorum = self.read_quorum(latest)
                if self.replica in quorum.members:
                    return quorum
                self._check_not_dead()
                after = latest  # not taken in yet (a replacement waits for the next one)
            if self.quorum is None and self.status().stop:
                raise DistributedError("the job stopped before this worker was taken in")
            if time.monotonic() > deadline:
                self._check_not_dead()
                raise DistributedError(
                    f"live fault tolerance: no quorum took this worker in within {timeout_s:g} "
                    "s (the launcher forms them; is it still running?)."
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def form(self, quorum: Quorum) -> str:
        """Build ``quorum``'s process group (collective over its members).

        Every member first marks itself arrived (``arrive/<q>/<id>``) and waits for the others,
        where it can see deaths and newer quorums; only then does it enter torch's
        ``init_process_group`` (a ``PrefixStore`` per quorum), so a member lost while the
        others wait costs no timeout.

        Returns:
            ``"built"``; ``"abandon"`` (a newer quorum or a member's death made it moot before
            any member built it: nobody votes on it); ``"failed"`` (a member was lost while the
            group was built: this member votes ``ok=False`` on it).
        """
        if arrival_outcome(self.store, quorum, self.replica, self.formation_timeout_s) != "go":
            return "abandon"
        self.break_group()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.quorum, self.seq = quorum, 0
        before = socket_inodes()
        try:
            dist.init_process_group(
                self.backend,
                store=dist.PrefixStore(key("pg", quorum.number) + "/", self.store),
                rank=quorum.rank_of(self.replica),
                world_size=len(quorum.members),
                timeout=datetime.timedelta(seconds=self.formation_timeout_s),
            )
            # gloo's connectFullMesh may return on one member while a peer still connects: no
            # member leaves the formation before every member is connected
            dist.barrier()
        except Exception as exc:  # noqa: BLE001 - a member lost while the group formed
            self._group_sockets = new_sockets(before)
            if not is_lost_peer(exc):
                raise
            self.break_group()
            return "failed"
        group = dist.group.WORLD
        assert group is not None
        group._get_backend(self.device).set_timeout(
            datetime.timedelta(seconds=self.train_timeout_s)
        )
        self._group_sockets = new_sockets(before)
        return "built"

    def break_group(self) -> None:
        """Shut down the current group's connections (see :mod:`ddpkit.live.sockets`): it is
        being discarded, and a peer still blocked on this member must fail now."""
        shut_down(self._group_sockets)
        self._group_sockets = {}

    # -- voting -------------------------------------------------------------------------------

    def vote(
        self, ok: bool, *, loss_sum: float = 0.0, num_samples: int = 0, op: str = ""
    ) -> Decision:
        """Vote on the current operation and return the members' decision.

        Not a torch collective (it goes through the store), but every member of the quorum
        must vote on every operation, in the same order.

        Raises:
            RefusedError: a peer found this worker dead before it voted.
        """
        quorum = self.quorum
        assert quorum is not None, "vote() before the first quorum formed"
        seq, self.seq = self.seq, self.seq + 1
        status = self.status()
        leave = bool(self.leave_signal and self.leave_signal())
        leave = leave and not status.stop and not self.stop_signal  # stopping: nobody leaves
        if leave:
            self.store.set(key("leave", self.replica), "1")
        mine = Vote(
            ok,
            status.latest,
            status.waiting,
            leave,
            status.stop,
            float(loss_sum),
            int(num_samples),
            op,
        )
        written = self.store.compare_set(
            key("vote", quorum.number, seq, self.replica), "", mine.encode()
        ).decode()
        if written == DEAD:
            raise RefusedError(
                "this worker was declared dead by the job while it was still running (it did "
                "not answer in time) and may not rejoin: its peers went on without it."
            )
        if not ok:
            self.store.add(key("failed", quorum.number), 1)
        votes = collect_votes(self.store, quorum, seq, self.replica, mine, self.hang_timeout_s)
        decision = decide(quorum, votes)
        self.last_decision = decision
        if seq >= 2:  # every member has read it: it decided seq - 1 already (bounded store)
            self.store.delete_key(key("vote", quorum.number, seq - 2, self.replica))
        return decision

    # -- guarded operations -------------------------------------------------------------------

    def attempt(
        self, op: str, fn: Callable[[], Any], *, loss_sum: float = 0.0, num_samples: int = 0
    ) -> Attempt:
        """Run ``fn`` (the collectives of one operation) and vote on whether it completed
        everywhere. Nested in another attempt, it just runs ``fn`` (the outer one votes).

        Collective: call on every member, for the same operations in the same order.

        Raises:
            Whatever ``fn`` raises that is not a lost peer (a bug in the operation).
        """
        if self._depth:
            return Attempt(fn(), Decision(commit=True, reconfigure=False))
        self._depth += 1
        self._attempt_start = time.monotonic()
        try:
            result, ok = fn(), True
        except Exception as exc:  # noqa: BLE001 - a lost peer is voted on; anything else raised
            if not is_lost_peer(exc):
                raise
            result, ok = None, False
            self.break_group()  # peers blocked on this member fail now, not at the timeout
            log.warning("%s failed on this member: %s", op, str(exc).strip().splitlines()[0])
        finally:
            self._depth -= 1
        return Attempt(result, self.vote(ok, loss_sum=loss_sum, num_samples=num_samples, op=op))

    def run(self, op: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` as a guarded operation until it commits; a failure moves every member to
        the next quorum and runs it again there (``fn`` must start over cleanly, e.g. an
        evaluation or a checkpoint save). Returns its result. At one member it just runs.

        Collective: call on every member.
        """
        if self.quorum is None or self._depth:
            return fn()
        while True:
            attempt = self.attempt(op, fn)
            self.settle(attempt.decision, op=op)
            if attempt.decision.commit:
                return attempt.result

    def settle(self, decision: Decision, *, op: str, step: int = 0) -> None:
        """Act on ``decision`` after the operation's effects were applied or dropped: note a
        stop, leave, or move to the next quorum. Collective (a quorum change) when
        ``decision.reconfigure``. ``step``: the training step's number, for a step."""
        if self.replica in decision.leaving:
            self._leave()
        self._note_stop(decision)
        self.admit_pending = self.admit_pending or decision.admit
        what = f"training step {step}" if step else op
        if not decision.commit:
            self.counters.discarded += 1
            self.counters.discarded_steps += int(bool(step))
        if decision.reconfigure:
            lost = bool(decision.dead or decision.leaving or not decision.commit)
            self.counters.failures += int(lost)
            if decision.commit:
                done = "committed"
            else:  # the time since the operation began was lost too
                spent = time.monotonic() - self._attempt_start
                self.counters.stall_s += spent
                done = f"discarded on every member after {spent:.2f} s"
            self.reconfigure(f"{what} {done}")

    def _leave(self) -> NoReturn:
        """This member is in the decision's leavers: it ends (exit 0), its peers go on."""
        raise LeftTheJob(self.leave_signal() if self.leave_signal else "")

    def _note_stop(self, decision: Decision) -> None:
        """The members agreed to stop: remember it (``stop_requested``), and withdraw a leave
        request of this member's own (it stops with the others, it does not leave them)."""
        if decision.stop and not self.stop_signal:
            self.stop_signal = decision.stop
            if self.store.check([key("leave", self.replica)]):
                self.store.delete_key(key("leave", self.replica))

    # -- moving to the next quorum --------------------------------------------------------------

    def reconfigure(self, note: str) -> None:
        """Move to the launcher's next quorum: build its group, heal its replacements, agree;
        then the new rank 0 logs one line (why, what was discarded, the stall, the heal).

        Collective over the next quorum's members. Waits for the launcher to form it (it does
        as soon as it knows who died, left or is ready to join).

        Raises:
            RefusedError: this worker was declared dead.
            DistributedError: no quorum took this worker in within ``formation_timeout_s`` x 5.
        """
        start, heal_before = time.monotonic(), self.counters.heal_s
        previous = self.quorum
        self.counters.reconfigurations += 1
        self._join(previous.number if previous else 0, start)
        stall = time.monotonic() - start
        self.counters.stall_s += stall
        quorum = self.quorum
        assert quorum is not None
        if quorum.rank_of(self.replica) != 0 or previous is None:
            return
        healed = ""
        if quorum.joiners:
            slots = ", ".join(str(slot_of(j)) for j in quorum.joiners)
            healed = (
                f"; slot(s) {slots} healed from slot {slot_of(self.replica)} (rank 0) at step "
                f"{self.step} in {self.counters.heal_s - heal_before:.2f} s"
            )
        log.warning(
            "live: %s; %s; world size %d -> %d (quorum %d); stall %.2f s%s",
            quorum.reason or "the members changed",
            note,
            len(previous.members),
            len(quorum.members),
            quorum.number,
            stall,
            healed,
        )

    def _join(self, after: int, start: float, wait_s: float | None = None) -> None:
        """Wait for (up to ``wait_s``; default 5 x the formation timeout), form, heal and
        agree on the next quorum newer than ``after``."""
        while True:
            quorum = self.wait_for_quorum(after, wait_s or self.formation_timeout_s * 5)
            after = quorum.number
            if not self.healed and self.replica not in quorum.joiners:
                continue  # a replacement is a member only once healed: wait to be taken in
            built = self.form(quorum)
            if built == "abandon":
                continue  # a newer quorum (the launcher knows more) is formed next
            ok = built == "built" and self._heal(quorum)
            decision = self.vote(ok, op="forming quorum")
            if not decision.commit:
                continue  # a member lost while forming or healing: the next quorum
            if not self.healed:
                self.healed = True
                self.store.set(key("healed", self.replica), "1")  # the launcher counts it in
            self._note_stop(decision)
            for callback in self.on_change:
                callback(quorum)
            if self.replica in decision.leaving:
                self._leave()
            if not decision.reconfigure:
                return

    def _heal(self, quorum: Quorum) -> bool:
        """Heal ``quorum``'s replacements (:func:`ddpkit.live.heal.transfer_state`); ``True``
        when the state arrived (or nobody needed it), ``False`` when a member was lost.
        Collective over ``quorum``."""
        if not quorum.joiners:
            return True
        try:
            seconds = transfer_state(
                quorum,
                self.replica,
                self.heal_source,
                self.heal_local,
                self.heal_sink,
                unsafe_pickle=self.heal_unsafe_pickle,
            )
        except Exception as exc:  # noqa: BLE001 - the replacement (or the sender) died
            if not is_lost_peer(exc):
                raise
            self.break_group()
            return False
        self.counters.heal_s += seconds
        self.counters.healed += 1 if self.replica in quorum.joiners else len(quorum.joiners)
        return True

    def admit(self) -> bool:
        """At a training step boundary: take the waiting replacements in (ask the launcher for
        the next quorum, form it, heal them). Returns whether the quorum changed.

        Collective over the members (all call it before the same step: the decision that set
        ``admit_pending`` was the same on every member).
        """
        if not self.admit_pending or self.quorum is None:
            return False
        self.admit_pending = False
        before = self.quorum
        self.store.compare_set(key("admit", before.number), "", "1")
        self.reconfigure(f"at step {self.step}")
        return self.quorum is not before

    def join_as_replacement(self) -> None:
        """A replacement's entry: say it is ready, then wait to be taken in and healed.

        Collective with the survivors (they heal it at their next step).
        """
        after = self.latest()  # read before saying ready: the quorum taking it in is newer
        self.healed = False
        self.store.set(key("ready", self.replica), "1")
        # the members take it in at their next step, however long their current one (an
        # evaluation) takes; the launcher ends it if the job ends first
        self._join(after, time.monotonic(), wait_s=REPLACEMENT_WAIT_S)

    def record_checkpoint(self, step: int, path: str) -> None:
        """Tell the launcher the newest complete checkpoint (it names it if the job ends)."""
        self.store.set(key("newest_checkpoint"), json.dumps({"step": step, "path": path}))

    def stop_requested(self) -> bool:
        """Whether the members agreed to stop (the launcher's stop signal, or every member's
        own at once)."""
        return bool(self.stop_signal)
