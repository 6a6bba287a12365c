"""The launcher's side of live fault tolerance: who is alive, and the quorums.

The launcher (``ddpkit run --fault-tolerance live``) starts the workers, so it knows at once
when one exits; the workers' heartbeats tell it when one stops answering (SIGSTOP, a frozen
node), and their votes when one hangs in its own code. :class:`Lighthouse` turns what it sees
into the store's records (:mod:`ddpkit.live.protocol`): a member declared dead, and the next
quorum (the survivors, then the replacements ready to be healed). It is one writer over one
store (torchft's "lighthouse" plays the same part), so there is nothing to agree on between
launchers on one node.

Not a collective: :meth:`Lighthouse.tick` runs in the launcher's loop, about every 50 ms.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field

import torch.distributed as dist

from ddpkit.live.protocol import HEARTBEAT_S, Quorum, Status, key, next_quorum

#: a member whose heartbeat has not moved for this long is declared dead (20 periods)
HEARTBEAT_TIMEOUT_S = 20 * HEARTBEAT_S
#: a failed operation with nobody dead: the quorum is formed again after this long
FAILED_GRACE_S = 1.0


@dataclass
class Replica:
    """What the lighthouse knows of one worker process.

    Attributes:
        replica: its id; slot: the launcher's slot it fills.
        alive: its process runs (the launcher's view); exit_code: once it ended.
        dead_why: why it was declared dead ("" while it is not).
        heartbeat, heartbeat_at: its last heartbeat count and when it last moved.
    """

    replica: str
    slot: int
    alive: bool = True
    exit_code: int | None = None
    dead_why: str = ""
    heartbeat: int = -1
    heartbeat_at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Event:
    """One thing the lighthouse did, for the launcher's event line.

    Attributes:
        kind: ``"dead"`` (``replica`` declared dead; ``kill`` it if its process still runs),
            ``"finished"`` (it ran its script to the end), ``"left"`` (it left on its own stop
            signal), ``"quorum"`` (``quorum`` published), ``"empty"`` (no member can go on:
            the job fails), ``"done"`` (every member finished).
        quiet: nothing worth a line (a quorum that only drops members that finished).
    """

    kind: str
    replica: str = ""
    why: str = ""
    kill: bool = False
    quorum: Quorum | None = None
    quiet: bool = False


class Lighthouse:
    """Declares workers dead and publishes quorums in the job's coordination store.

    Rules (each quorum: the previous one's members still alive, in their order, then the
    replacements taken in):

    - a worker whose process ended with a non-zero status (or a signal), whose heartbeat stopped
      for ``heartbeat_timeout_s``, or whom its peers reported hung, is declared dead (a store
      key its peers read; the launcher kills it if it still runs);
    - one that left on its own stop signal, or ran its script to the end (exit 0), leaves the
      next quorum (a finished one gets the dead key too, so its peers stop waiting for its
      vote, but no replacement and no event line);
    - ready replacements are taken in only when the members ask (``admit/<q>``: they are at a
      step boundary), and count as members only once they confirm their heal (``healed/<id>``):
      a quorum formed before that (a survivor lost during the heal) leaves them out, and they
      are taken in again at a later step;
    - an initial worker that ends before the first quorum ends the job (``empty``).

    Args:
        store: the store the launcher hosts.
        num_initial: workers the first quorum waits for.
        heartbeat_timeout_s: a member whose heartbeat stops for this long is declared dead.
    """

    def __init__(
        self,
        store: dist.Store,
        num_initial: int,
        *,
        heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
    ) -> None:
        self.store = store
        self.num_initial = num_initial
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.replicas: dict[str, Replica] = {}
        self.quorum: Quorum | None = None
        self.left: set[str] = set()
        self.unhealed: set[str] = set()  # taken in, heal not confirmed yet
        self._failed_seen_at: float | None = None
        self._reasons: list[str] = []
        self._loud = False  # a reason worth a line (not only members that finished)
        self.status = Status()
        self.store.set(key("status"), self.status.encode())

    def add(self, replica: str, slot: int) -> None:
        """A worker process the launcher started (or a spare it activated)."""
        self.replicas[replica] = Replica(replica, slot)

    def exited(self, replica: str, exit_code: int) -> None:
        """The launcher saw this worker's process end."""
        info = self.replicas[replica]
        info.alive, info.exit_code = False, exit_code

    def stop_job(self, signal_name: str) -> None:
        """Ask every member to stop at the next operation, together (a stop signal)."""
        self._set_status(dataclasses.replace(self.status, stop=signal_name))

    def _set_status(self, status: Status) -> None:
        """Publish ``status`` to the members if it differs from the current one."""
        if status != self.status:
            self.status = status
            self.store.set(key("status"), status.encode())

    def members_alive(self) -> list[str]:
        """Members of the current quorum that can go on (alive, healed, not leaving)."""
        if self.quorum is None:
            return []
        return [m for m in self.quorum.members if self._usable(m) and m not in self.unhealed]

    def _usable(self, replica: str) -> bool:
        info = self.replicas.get(replica)
        return info is not None and info.alive and not info.dead_why and replica not in self.left

    def finished(self, replica: str) -> bool:
        """The worker ran its script to the end (exit status 0, not leaving on its own signal)."""
        info = self.replicas[replica]
        return info.exit_code == 0 and replica not in self.left

    def tick(self, now: float | None = None) -> list[Event]:
        """Look at heartbeats, exits, leave requests, failures and ready replacements; declare
        the dead and publish the next quorum when anything changed. Returns what it did:
        ``dead``/``left`` events, a ``quorum``, and ``empty`` (no member can go on, and not
        because all finished) or ``done`` (every member finished)."""
        now = time.monotonic() if now is None else now
        if self.quorum is None:
            return self._first_quorum()
        events = self._find_dead(now)
        self.unhealed = {r for r in self.unhealed if not self.store.check([key("healed", r)])}
        members = self.quorum.members
        ready = [
            r
            for r, _ in self.replicas.items()
            if (r not in members or r in self.unhealed)
            and self._usable(r)
            and self.store.check([key("ready", r)])
        ]
        self._set_status(
            dataclasses.replace(self.status, waiting=len([r for r in ready if r not in members]))
        )
        admit = self.store.check([key("admit", self.quorum.number)])
        gone = [m for m in members if not self._usable(m)]
        failed = self._failed_without_death(now, gone)
        if not (gone or admit or failed):
            return events
        alive = self.members_alive()
        if not alive:
            ending = "done" if self.all_finished() else "empty"
            return [*events, Event(ending, why="; ".join(self._reasons))]
        joining = sorted(ready, key=self._slot) if admit else []  # only at a step boundary
        reasons = self._reasons + ([f"{len(joining)} replacement(s) taken in"] if joining else [])
        reasons += ["an operation failed"] if failed else []
        quorum = next_quorum(self.quorum, alive, joining, "; ".join(reasons))
        assert quorum is not None
        loud = self._loud or bool(joining) or failed
        self._publish(quorum)
        return [*events, Event("quorum", quorum=quorum, quiet=not loud)]

    def all_finished(self) -> bool:
        """Whether every member of the current quorum (replacements not healed yet aside) ran
        its script to the end."""
        members = self.quorum.members if self.quorum is not None else ()
        return bool(members) and all(self.finished(m) for m in members if m not in self.unhealed)

    def _slot(self, replica: str) -> int:
        return self.replicas[replica].slot

    def _first_quorum(self) -> list[Event]:
        for info in self.replicas.values():
            if not info.alive:  # a start-up failure ends the job, as torchrun's would
                why = f"slot {info.slot} {_exit_words(info.exit_code)} before the job started"
                return [Event("empty", why=why)]
        registered = [r for r in self.replicas if self.store.check([key("replica", r)])]
        if len(registered) < self.num_initial:
            return []
        members = sorted(registered, key=self._slot)[: self.num_initial]
        quorum = next_quorum(None, members, members, "start")
        assert quorum is not None
        self._publish(quorum)
        return [Event("quorum", quorum=quorum)]

    def _publish(self, quorum: Quorum) -> None:
        self.store.set(key("quorum", quorum.number), quorum.encode())
        self.store.add(key("quorum", "latest"), 1)
        self.quorum = quorum
        self.unhealed |= set(quorum.joiners)
        self._failed_seen_at = None
        self._reasons, self._loud = [], False
        waiting = self.status.waiting - len(quorum.joiners)
        self._set_status(
            dataclasses.replace(self.status, latest=quorum.number, waiting=max(waiting, 0))
        )

    def declare_dead(self, replica: str, why: str, *, quiet: bool = False) -> Event:
        """Record ``replica`` as dead (its peers stop waiting for it; it may never rejoin);
        ``quiet``: it finished its script (no line, no replacement)."""
        info = self.replicas[replica]
        info.dead_why = why
        self.store.set(key("dead", replica), why)
        self._reasons.append(f"slot {info.slot} {why}")
        if not quiet:
            self._loud = True
        return Event("finished" if quiet else "dead", replica, why, kill=info.alive)

    def _find_dead(self, now: float) -> list[Event]:
        """Exits (died, left on its own signal, or finished), silent and hung workers."""
        assert self.quorum is not None
        events = []
        watched = [r for r, i in self.replicas.items() if not i.dead_why and r not in self.left]
        for replica in watched:
            info = self.replicas[replica]
            if not info.alive and info.exit_code == 0 and self.store.check([key("leave", replica)]):
                events.append(self._left(replica))  # its leave was agreed; it is gone now
            elif not info.alive:
                finished = info.exit_code == 0
                why = "finished its script (exit 0)" if finished else _exit_words(info.exit_code)
                events.append(self.declare_dead(replica, why, quiet=finished))
            elif why := self._silent(info, now) or self._suspected(replica):
                events.append(self.declare_dead(replica, why))
        return events

    def _silent(self, info: Replica, now: float) -> str:
        """Why a registered worker counts as not answering, else ``""``."""
        name = key("hb", info.replica)
        if not self.store.check([name]):
            return ""  # still starting: its process exit is what counts
        count = int(self.store.add(name, 0))
        if count != info.heartbeat:
            info.heartbeat, info.heartbeat_at = count, now
            return ""
        if now - info.heartbeat_at > self.heartbeat_timeout_s:
            return f"stopped answering (no heartbeat for {now - info.heartbeat_at:.1f} s)"
        return ""

    def _suspected(self, replica: str) -> str:
        name = key("suspect", replica)
        if self.store.check([name]):
            return f"hung (its peers waited {self.store.get(name).decode()} s for it)"
        return ""

    def _left(self, replica: str) -> Event:
        """``replica`` left on its own stop signal (its peers agreed, it exited 0)."""
        self.left.add(replica)
        slot = self.replicas[replica].slot
        self._reasons.append(f"slot {slot} left (its own stop signal)")
        self._loud = True
        return Event("left", replica, "its own stop signal")

    def _failed_without_death(self, now: float, gone: list[str]) -> bool:
        """An operation failed on a member but nobody is known dead: after a short grace (a
        death is usually seen by then), form the quorum again."""
        assert self.quorum is not None
        if gone or not int(self.store.add(key("failed", self.quorum.number), 0)):
            return False
        if self._failed_seen_at is None:
            self._failed_seen_at = now
        return now - self._failed_seen_at > FAILED_GRACE_S

    def newest_checkpoint(self) -> str:
        """The newest checkpoint the workers reported (``""`` if none)."""
        if not self.store.check([key("newest_checkpoint")]):
            return ""
        return json.loads(self.store.get(key("newest_checkpoint")))["path"]


def _exit_words(code: int | None) -> str:
    if code is None:
        return "died"
    if code < 0:
        import signal

        try:
            return f"died ({signal.Signals(-code).name})"
        except ValueError:
            return f"died (signal {-code})"
    return f"exited with status {code}"
