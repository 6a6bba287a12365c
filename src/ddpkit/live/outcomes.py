"""What a guarded operation can come to, besides a commit: the exceptions and counters of live
fault tolerance, and which errors mean a peer was lost."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddpkit.diagnostics.peers import LOST_PEER_ANY, TOLD_ENDED, TOLD_SILENT, mentions
from ddpkit.errors import DistributedError
from ddpkit.live.protocol import Decision

_LOST_PEER = (*LOST_PEER_ANY, TOLD_ENDED, TOLD_SILENT)  # gloo's words, and ddpkit's for them


def is_lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a collective broken by a peer that died or hung."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, RuntimeError) and mentions(str(seen), _LOST_PEER):
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


class LeftTheJob(SystemExit):
    """This member left the job on a stop signal of its own; its peers go on without it. A
    ``SystemExit`` with status 0: the worker ends cleanly, from whatever operation it was in."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(0)
        self.signal_name = signal_name

    def __str__(self) -> str:
        return f"left the job on {self.signal_name or 'a stop signal'} of its own"


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
