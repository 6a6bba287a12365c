"""The records live fault tolerance keeps in the job's coordination store, and the one rule that
turns the members' votes into a decision.

The store is a ``torch.distributed.TCPStore`` that ``ddpkit run --fault-tolerance live`` hosts
in the launcher (bound to loopback, like every ddpkit listener), so it outlives any worker. Its
atomic operations (``add``, ``compare_set``) are the only agreement mechanism: no protocol of
ddpkit's own runs between the workers.

Keys (all under ``live/``):

=================================  ==============================================================
``hb/<replica>``                   heartbeat counter, added to every ``HEARTBEAT_S`` by a worker
``replica/<replica>``              a worker's registration (JSON: slot, pid, host)
``ready/<replica>``                a replacement is ready to be healed (set in ``resume()``)
``quorum/latest``                  the newest quorum's number (a counter: 0 = none yet)
``quorum/<q>``                     quorum ``q`` (JSON :class:`Quorum`), written before ``latest``
``status``                         what every vote reads (JSON :class:`Status`): the newest
                                   quorum, replacements waiting, the job's stop
``admit/<q>``                      the members of ``q`` are at a step boundary and take the
                                   waiting replacements in (the next quorum holds them)
``dead/<replica>``                 why the launcher declared a worker dead
``leave/<replica>``                a worker's own stop signal: it leaves after the next vote
``vote/<q>/<seq>/<replica>``       a member's :class:`Vote` on operation ``seq`` of quorum ``q``,
                                   written with ``compare_set``; ``DEAD`` when a peer found the
                                   member dead first (the member then refuses to go on)
``failed/<q>``                     counter: members of ``q`` whose operation failed
``suspect/<replica>``              a member waited past the hang timeout for this one's vote
``arrive/<q>/<replica>``           a member of ``q`` is ready to build its process group
``outcome/<q>``                    ``go`` or ``abandon``: the first member to decide writes it
``healed/<replica>``               a replacement's heal committed: it is a member from now on
``newest_checkpoint``              the newest complete checkpoint (JSON: step, path)
=================================  ==============================================================
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from ddpkit.errors import DistributedError

PREFIX = "live/"
MODES = ("restart", "live")  # fault tolerance: torchrun's restarts, or live (this package)
HEARTBEAT_S = 0.5  # a worker's heartbeat period
DEAD = "DEAD"  # the tombstone a peer writes into a dead member's missing vote

STORE_ENV = "DDPKIT_LIVE_STORE"  # host:port of the coordination store
REPLICA_ENV = "DDPKIT_LIVE_REPLICA"  # this worker's replica id ("s<slot>-" + 128 random bits)
SLOT_ENV = "DDPKIT_LIVE_SLOT"  # the launcher's slot (0..nproc-1) the worker fills


def slot_of(replica: str) -> int:
    """The launcher's slot a replica id names (``s2-<hex>`` -> 2; -1 if it names none)."""
    head = replica.split("-", 1)[0]
    return int(head[1:]) if head[:1] == "s" and head[1:].isdigit() else -1


def key(*parts: object) -> str:
    """``live/part/part/...``."""
    return PREFIX + "/".join(str(p) for p in parts)


@dataclass(frozen=True)
class Quorum:
    """One membership of the job.

    Attributes:
        number: ``q``, from 1, increasing.
        members: replica ids in rank order: the survivors of the previous quorum first (in
            their order), then the replacements joining (``joiners``).
        joiners: members that must be healed from a live peer when the group forms.
        reason: why it formed (for the event line), e.g. ``"rank 2 died (SIGKILL)"``.
    """

    number: int
    members: tuple[str, ...]
    joiners: tuple[str, ...] = ()
    reason: str = ""

    def encode(self) -> str:
        return json.dumps(
            {"members": list(self.members), "joiners": list(self.joiners), "reason": self.reason}
        )

    @classmethod
    def decode(cls, number: int, text: str | bytes) -> Quorum:
        data = json.loads(text)
        return cls(number, tuple(data["members"]), tuple(data["joiners"]), data.get("reason", ""))

    def rank_of(self, replica: str) -> int:
        """This replica's rank in the quorum's process group (its index in ``members``)."""
        return self.members.index(replica)


@dataclass(frozen=True)
class Status:
    """The launcher's word to the members, read once per vote.

    Attributes:
        latest: the newest quorum's number.
        waiting: replacements ready to be healed, waiting to be taken in.
        stop: the stop signal the launcher received (its name), else ``""``.
    """

    latest: int = 0
    waiting: int = 0
    stop: str = ""

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, text: str | bytes) -> Status:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class Vote:
    """What a member says at the end of one operation of a quorum.

    Attributes:
        ok: every collective of the operation completed on this member.
        quorum_seen: the newest quorum number this member had seen when it voted.
        waiting: replacements this member saw waiting to be taken in.
        leave: this member got a stop signal of its own and leaves after this operation.
        stop: the launcher asked the whole job to stop (the signal's name), else ``""``.
        loss_sum, num_samples: this member's summed loss and samples of a training step
            (0 for other operations): every member then knows the step's global loss.
        op: the operation voted on ("training step", "evaluation", ...).
    """

    ok: bool
    quorum_seen: int
    waiting: int = 0
    leave: bool = False
    stop: str = ""
    loss_sum: float = 0.0
    num_samples: int = 0
    op: str = ""

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, text: str | bytes) -> Vote | None:
        """The vote, or ``None`` for :data:`DEAD` (a peer found the member dead first)."""
        if (text.decode() if isinstance(text, bytes) else text) == DEAD:
            return None
        return cls(**json.loads(text))


@dataclass(frozen=True)
class Decision:
    """The outcome of one operation, the same on every member that reads the same votes.

    Attributes:
        commit: every member voted ``ok``: the operation's effects stand (a training step's
            optimizer update is applied). Otherwise they are discarded everywhere.
        reconfigure: the members must move to a newer quorum after this operation: it failed,
            a member is dead or leaving, or the launcher formed a newer quorum.
        admit: replacements are waiting: the members take them in at the start of the next
            training step (only there is every member at the point a replacement starts from:
            after the caller's code of the last step, before the next step draws its batches).
        stop: the job stops at this operation (the launcher's stop signal, or every member
            leaving), else ``""``.
        dead: members found dead without a vote.
        leaving: members leaving after this operation.
        loss_sum, num_samples: over the members that voted.
    """

    commit: bool
    reconfigure: bool
    admit: bool = False
    stop: str = ""
    dead: tuple[str, ...] = ()
    leaving: tuple[str, ...] = ()
    loss_sum: float = 0.0
    num_samples: int = 0
    votes: dict[str, Vote] = field(default_factory=dict, compare=False, repr=False)


def decide(quorum: Quorum, votes: dict[str, Vote | None]) -> Decision:
    """The decision for one operation of ``quorum`` from its final votes.

    ``votes[m]`` is member ``m``'s vote, or ``None`` when ``m`` was found dead before voting
    (its vote key holds :data:`DEAD`). The rule: commit only if every member voted ``ok``;
    move to a newer quorum if not, or if anyone is dead or leaving, or saw a newer quorum.
    Every member reads the same final votes (each is written once, atomically), so every
    member reaches the same decision: replicas never fork.
    """
    cast = {m: v for m, v in votes.items() if v is not None}
    ops = sorted({v.op for v in cast.values()})
    if len(ops) > 1:
        raise DistributedError(
            f"live fault tolerance: the members ran different operations at the same point "
            f"({' and '.join(repr(op) for op in ops)}), so their collectives did not match. "
            "Every member must run the same ddpkit operations in the same order; a replacement "
            "runs none between CheckpointManager.resume() and its first train_epoch step."
        )
    dead = tuple(m for m in quorum.members if votes.get(m) is None)
    leaving = tuple(m for m, v in cast.items() if v.leave)
    commit = not dead and all(v.ok for v in cast.values())
    newer = max((v.quorum_seen for v in cast.values()), default=quorum.number) > quorum.number
    stop = next((v.stop for v in cast.values() if v.stop), "")
    if leaving and len(leaving) == len(quorum.members):  # Slurm signals every process: a stop
        stop, leaving = stop or "every member leaving", ()
    reconfigure = bool(not commit or dead or leaving or newer)
    return Decision(
        commit=commit,
        reconfigure=reconfigure,
        admit=not reconfigure and any(v.waiting for v in cast.values()),
        stop=stop,
        dead=dead,
        leaving=leaving,
        loss_sum=sum(v.loss_sum for v in cast.values()),
        num_samples=sum(v.num_samples for v in cast.values()),
        votes=cast,
    )


def next_quorum(
    previous: Quorum | None, alive: list[str], ready: list[str], reason: str
) -> Quorum | None:
    """The quorum after ``previous``: its members still ``alive`` (in their order), then the
    ``ready`` replacements (in the order given). ``None`` when it would have no member.

    Joiners are only the ready replacements, and only when a survivor can heal them; without
    any survivor (the job's first quorum) nobody is healed: they start (or resume from a
    checkpoint) together. The launcher passes ``ready`` only when the members asked to take
    replacements in (``admit/<q>``), i.e. at a step boundary.
    """
    number = previous.number + 1 if previous is not None else 1
    kept = [m for m in (previous.members if previous else ()) if m in alive]
    new = [m for m in ready if m not in kept]
    members = tuple(kept + new)
    if not members:
        return None
    joiners = tuple(new) if kept else ()
    return Quorum(number, members, joiners, reason)
