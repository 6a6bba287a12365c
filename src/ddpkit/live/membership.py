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
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.errors import ConfigError, DistributedError
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

# gloo's words for a collective a peer's death broke (and the store's, for a lost launcher)
_LOST_PEER = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Read error",
    "Write error",
    "Broken pipe",
    "Timed out waiting",
    "Socket closed",
    "connectFullMesh",
    "Connection refused",
    "a peer's process ended",
    "a peer stopped answering",
)


def is_lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a collective broken by a peer that died or hung."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, RuntimeError) and any(m in str(seen) for m in _LOST_PEER):
            return True
        seen = seen.__cause__
    return False


class StepDiscarded(Exception):  # noqa: N818 - an outcome, not an error
    """A training step was discarded on every member (a member died or failed during it); the
    members have moved to the next quorum. :func:`ddpkit.train_epoch` trains its samples again.

    Attributes:
        step: the number the discarded step would have had.
    """

    def __init__(self, step: int) -> None:
        super().__init__(f"training step {step} discarded on every member")
        self.step = step


class RefusedError(DistributedError):
    """This worker was declared dead by the job (it stopped answering) and may not rejoin."""


@dataclass
class Attempt:
    """One guarded operation's outcome on this member.

    Attributes:
        result: what the operation returned (``None`` when it failed here).
        decision: the members' agreed :class:`~ddpkit.live.protocol.Decision`.
    """

    result: Any
    decision: Decision


@dataclass
class LiveCounters:
    """What live fault tolerance did in this process (for the summary and goodput).

    Attributes:
        failures: quorum changes caused by a member that died, hung or left.
        discarded: operations discarded (training steps among them: ``discarded_steps``).
        discarded_steps: training steps discarded (trained again after the change).
        stall_s: seconds spent moving to new quorums (waiting, forming, healing).
        heal_s: seconds of those spent sending or receiving state.
        healed: replacements this process healed (as the sender) or 1 when it was healed.
        reconfigurations: quorum changes this process went through.
    """

    failures: int = 0
    discarded: int = 0
    discarded_steps: int = 0
    stall_s: float = 0.0
    heal_s: float = 0.0
    healed: int = 0
    reconfigurations: int = 0


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
        self.left = False  # this member left (its own stop signal) and must not go on
        self.admit_pending = False  # replacements wait: take them in before the next step
        self.leave_signal: Callable[[], str] | None = None  # "" or this process's own signal
        self.step = 0  # optimizer steps committed (set by resume, counted by TrainStep)
        self.heal_source: Callable[[], dict[str, Any]] | None = None  # rank 0: the state
        self.heal_local: Callable[[], Any] | None = None  # every member: its RNG states
        self.heal_sink: Callable[[dict[str, Any], list[Any]], None] | None = None  # load
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

    def form(self, quorum: Quorum) -> bool:
        """Build ``quorum``'s process group (collective over its members); ``False`` when a
        newer quorum or a member's death makes it moot before it is built.

        Every member first counts itself in ``arrive/<q>`` and waits for the others there,
        where it can see deaths and newer quorums; only then does it enter torch's
        ``init_process_group`` (a ``PrefixStore`` per quorum), so a member lost while the
        others wait costs no timeout.
        """
        if self._outcome(quorum) != "go":
            return False
        self.break_group()
        if dist.is_initialized():
            dist.destroy_process_group()
        before = socket_inodes()
        prefix = dist.PrefixStore(key("pg", quorum.number) + "/", self.store)
        dist.init_process_group(
            self.backend,
            store=prefix,
            rank=quorum.rank_of(self.replica),
            world_size=len(quorum.members),
            timeout=datetime.timedelta(seconds=self.formation_timeout_s),
            device_id=self.device if self.backend == "nccl" else None,
        )
        group = dist.group.WORLD
        assert group is not None
        # gloo's connectFullMesh may return on one member while a peer still connects: no
        # member leaves the formation before every member is connected
        dist.barrier()
        group._get_backend(self.device).set_timeout(
            datetime.timedelta(seconds=self.train_timeout_s)
        )
        self._group_sockets = new_sockets(before)
        self.quorum, self.seq = quorum, 0
        return True

    def break_group(self) -> None:
        """Shut down the current group's connections (see :mod:`ddpkit.live.sockets`): it is
        being discarded, and a peer still blocked on this member must fail now."""
        shut_down(self._group_sockets)
        self._group_sockets = {}

    def _outcome(self, quorum: Quorum) -> str:
        """``"go"`` once every member arrived, ``"abandon"`` when a member died first or a
        newer quorum exists: whichever a member writes first (``compare_set``) holds for all,
        so no member builds a group its peers gave up on."""
        arrive, outcome = key("arrive", quorum.number), key("outcome", quorum.number)
        self.store.add(arrive, 1)
        pause = 0.001
        while True:
            if int(self.store.add(arrive, 0)) >= len(quorum.members):
                return self.store.compare_set(outcome, "", "go").decode()
            if self.store.check([outcome]) or self.latest() > quorum.number or any(
                self.store.check([key("dead", m)]) for m in quorum.members
            ):
                return self.store.compare_set(outcome, "", "abandon").decode()
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

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
        leave = bool(self.leave_signal and self.leave_signal()) and not status.stop
        if leave:
            self.store.set(key("leave", self.replica), "1")
        mine = Vote(
            ok, status.latest, status.waiting, leave, status.stop, float(loss_sum),
            int(num_samples), op,
        )  # fmt: skip
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
        votes = self._collect(quorum, seq, mine)
        decision = decide(quorum, votes)
        self.last_decision = decision
        return decision

    def _collect(self, quorum: Quorum, seq: int, mine: Vote) -> dict[str, Vote | None]:
        """Every member's vote on ``seq``: waited for, or :data:`DEAD` written in for a member
        the launcher declared dead before it voted (whoever writes first wins, atomically)."""
        names = {m: key("vote", quorum.number, seq, m) for m in quorum.members}
        votes: dict[str, Vote | None] = {self.replica: mine}
        pending = [m for m in quorum.members if m != self.replica]
        start, pause, reported = time.monotonic(), 0.0005, set()
        while pending:
            if self.store.check([names[m] for m in pending]):
                for member, text in zip(
                    pending, self.store.multi_get([names[m] for m in pending]), strict=True
                ):
                    votes[member] = Vote.decode(text)
                break
            for member in list(pending):
                if self.store.check([names[member]]):
                    votes[member] = Vote.decode(self.store.get(names[member]))
                    pending.remove(member)
                elif self.store.check([key("dead", member)]):  # DEAD unless it voted first
                    votes[member] = Vote.decode(self.store.compare_set(names[member], "", DEAD))
                    pending.remove(member)
            waited = time.monotonic() - start
            if waited > self.hang_timeout_s:
                for member in set(pending) - reported:
                    self.store.set(key("suspect", member), f"{waited:.0f}")
                    reported.add(member)
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        return votes

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
            self.left = True
            return
        if decision.stop and not self.stop_signal:
            self.stop_signal = decision.stop
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
            quorum.reason or "the members changed", note, len(previous.members),
            len(quorum.members), quorum.number, stall, healed,
        )  # fmt: skip

    def _join(self, after: int, start: float, wait_s: float | None = None) -> None:
        """Wait for (up to ``wait_s``; default 5 x the formation timeout), form, heal and
        agree on the next quorum newer than ``after``."""
        while True:
            quorum = self.wait_for_quorum(after, wait_s or self.formation_timeout_s * 5)
            after = quorum.number
            try:
                formed = self.form(quorum)
            except Exception as exc:  # noqa: BLE001 - a member lost while the group formed
                if not is_lost_peer(exc):
                    raise
                self.break_group()
                formed = False
            if not formed:
                continue  # a newer quorum (the launcher knows more) is formed next
            ok = self._heal(quorum)
            decision = self.vote(ok, op="forming quorum")
            if decision.commit:
                for callback in self.on_change:
                    callback(quorum)
                if not decision.reconfigure:
                    return
                if self.replica in decision.leaving:
                    self.left = True
                    return
            # a member lost while forming or healing, or already a newer quorum: go again

    def _heal(self, quorum: Quorum) -> bool:
        """Rank 0 (a survivor) sends the training state to the quorum's replacements; ``True``
        when it arrived (or nobody needed it). Collective over ``quorum``."""
        if not quorum.joiners:
            return True
        start = time.monotonic()
        joining = self.replica in quorum.joiners
        try:
            payload = [self._payload() if quorum.rank_of(self.replica) == 0 else None]
            dist.broadcast_object_list(payload, group_src=0)
            local = None if joining or self.heal_local is None else self.heal_local()
            rng_by_rank: list[Any] = [None] * len(quorum.members)
            dist.all_gather_object(rng_by_rank, local)
            if joining:
                if self.heal_sink is None:
                    raise ConfigError(
                        "live fault tolerance: a replacement received the job's state but has "
                        "nothing to load it into. Build a CheckpointManager(state=...) and call "
                        "its resume() before the first training step."
                    )
                self.heal_sink(payload[0], rng_by_rank)
        except Exception as exc:  # noqa: BLE001 - the replacement (or the sender) died
            if not is_lost_peer(exc):
                raise
            self.break_group()
            return False
        self.counters.heal_s += time.monotonic() - start
        self.counters.healed += 1 if joining else len(quorum.joiners)
        return True

    def _payload(self) -> dict[str, Any] | None:
        if self.heal_source is None:
            raise ConfigError(
                "live fault tolerance: a replacement needs the job's state and this member has "
                "none registered. Build a CheckpointManager(state=...) (it registers its state "
                "for healing) before the first training step."
            )
        return self.heal_source()

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
        self.store.set(key("ready", self.replica), "1")
        # the members take it in at their next step, however long their current one (an
        # evaluation) takes; the launcher ends it if the job ends first
        self._join(self.latest(), time.monotonic(), wait_s=REPLACEMENT_WAIT_S)

    def record_checkpoint(self, step: int, path: str) -> None:
        """Tell the launcher the newest complete checkpoint (it names it if the job ends)."""
        self.store.set(key("newest_checkpoint"), json.dumps({"step": step, "path": path}))

    def stop_requested(self) -> bool:
        """Whether the members agreed to stop (the launcher's stop signal) or this member left."""
        return bool(self.stop_signal) or self.left


