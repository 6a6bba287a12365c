"""The two waits where members agree through the store: arriving at a quorum, and collecting
an operation's votes. Each ends in a state every member reads the same way, because the one
value that decides it is written once, with the store's atomic ``compare_set``."""

from __future__ import annotations

import time

import torch.distributed as dist

from ddpkit.live.protocol import DEAD, Quorum, Vote, key


def arrival_outcome(store: dist.Store, quorum: Quorum, timeout_s: float) -> str:
    """Count this member in at ``quorum`` and wait for the others: ``"go"`` once every member
    arrived, ``"abandon"`` when a member died first, a newer quorum exists or ``timeout_s``
    passed (a member that never came: the launcher acts on it). Whichever a member writes first
    holds for all, so no member builds a group its peers gave up on."""
    arrive, outcome = key("arrive", quorum.number), key("outcome", quorum.number)
    store.add(arrive, 1)
    pause, deadline = 0.001, time.monotonic() + timeout_s
    while True:
        if int(store.add(arrive, 0)) >= len(quorum.members):
            return store.compare_set(outcome, "", "go").decode()
        if (
            store.check([outcome])
            or int(store.add(key("quorum", "latest"), 0)) > quorum.number
            or time.monotonic() > deadline
            or any(store.check([key("dead", m)]) for m in quorum.members)
        ):
            return store.compare_set(outcome, "", "abandon").decode()
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


def collect_votes(
    store: dist.Store, quorum: Quorum, seq: int, me: str, mine: Vote, hang_timeout_s: float
) -> dict[str, Vote | None]:
    """Every member's vote on operation ``seq`` of ``quorum`` (``None``: found dead first).

    A member the launcher declared dead before it voted gets :data:`DEAD` written in its place
    (whoever writes first wins, atomically; a vote it wrote before dying stands). A member
    waited for longer than ``hang_timeout_s`` is reported (``suspect/<id>``): the launcher
    then ends it and declares it dead.
    """
    names = {m: key("vote", quorum.number, seq, m) for m in quorum.members}
    votes: dict[str, Vote | None] = {me: mine}
    pending = [m for m in quorum.members if m != me]
    start, pause, reported = time.monotonic(), 0.0005, set()
    while pending:
        if store.check([names[m] for m in pending]):
            texts = store.multi_get([names[m] for m in pending])
            votes.update({m: Vote.decode(t) for m, t in zip(pending, texts, strict=True)})
            break
        for member in list(pending):
            if store.check([names[member]]):
                votes[member] = Vote.decode(store.get(names[member]))
                pending.remove(member)
            elif store.check([key("dead", member)]):  # DEAD unless it voted first
                votes[member] = Vote.decode(store.compare_set(names[member], "", DEAD))
                pending.remove(member)
        waited = time.monotonic() - start
        if waited > hang_timeout_s:
            for member in set(pending) - reported:
                store.set(key("suspect", member), f"{waited:.0f}")
                reported.add(member)
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
    return votes
