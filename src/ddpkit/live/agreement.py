"""The two waits where members agree through the store: arriving at a quorum, and collecting
an operation's votes. Each ends in a state every member reads the same way, because the one
value that decides it is written once, with the store's atomic ``compare_set``."""

from __future__ import annotations

import time

import torch.distributed as dist

from ddpkit.live.protocol import DEAD, Quorum, Vote, key


def arrival_outcome(store: dist.Store, quorum: Quorum, me: str, timeout_s: float) -> str:
    """Mark this member arrived at ``quorum`` and wait for the others: ``"go"`` once every
    member arrived, ``"abandon"`` when a member died first, a newer quorum exists or
    ``timeout_s`` passed (the members that never came are then reported as hung, and the
    launcher ends them). Whichever a member writes first holds for all, so no member builds a
    group its peers gave up on."""
    arrived = {m: key("arrive", quorum.number, m) for m in quorum.members}
    outcome = key("outcome", quorum.number)
    store.set(arrived[me], "1")
    pause, deadline = 0.001, time.monotonic() + timeout_s
    while True:
        if store.check(list(arrived.values())):
            return store.compare_set(outcome, "", "go").decode()
        late = time.monotonic() > deadline
        if (
            late
            or store.check([outcome])
            or int(store.add(key("quorum", "latest"), 0)) > quorum.number
            or any(store.check([key("dead", m)]) for m in quorum.members)
        ):
            if late:
                for member in [m for m, name in arrived.items() if not store.check([name])]:
                    store.set(key("suspect", member), f"{timeout_s:.0f}")
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
    start, pause = time.monotonic(), 0.0005
    reported: set[str] = set()
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
