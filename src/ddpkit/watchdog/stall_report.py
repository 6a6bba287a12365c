"""The watchdog's verdicts and reports, from every rank's :class:`~ddpkit.watchdog.position.
Position`: pure functions, no store, no thread.

- :func:`find_deadlock`: every rank is blocked in a collective (or in DDP's backward), and no
  collective has all of its group's members in it. Nothing can finish then: each rank waits for
  ranks that wait elsewhere. (A collective whose members are all present is in progress, however
  slow: that is the stall timeout's business, never a deadlock.)
- :func:`deadlock_report` / :func:`stall_report`: the text, one line per rank naming its
  collective and the user's source line, then the advice.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ddpkit.watchdog.position import BACKWARD, COLLECTIVE, DATALOADER_WAIT, RUNNING, Position

DEADLOCK_ADVICE = (
    "Every rank must call the same collectives in the same order, on the same group: a "
    "collective inside `if rank == 0:` (or any branch that differs between ranks) is the usual "
    "cause. Call it on every rank, or move it out of the branch."
)
DDP_FORWARD_ADVICE = (
    "A forward through the DDP wrapper with grad enabled is a collective (DDP broadcasts the "
    "buffers and, after the first backward, rebuilds its buckets in it), so a forward that some "
    "ranks run and others do not deadlocks: {cause}. Evaluate under torch.no_grad(), on "
    "ddpkit.unwrap_model(model), or with ddpkit.evaluate(model, loader, rt); uneven training "
    "data: ddpkit.join_uneven_inputs."
)
STALL_ADVICE = (
    "If the busy rank does legitimate work the others wait for (rank 0 downloading or "
    "preprocessing), run it under `with rt.main_process_first():` (the others wait at its "
    "barrier without a stall report), or raise the threshold: init_runtime(stall_timeout_s=...), "
    "ddpkit train --stall-timeout."
)
DATALOADER_ADVICE = (
    "Rank(s) {names} wait for their DataLoader's worker processes: a worker is slow, or stuck "
    "(`py-spy dump --pid PID` on the rank's child processes shows where). A worker that died "
    "would have raised in its rank; one whose stack under `gdb -p PID` ends in "
    "PyOS_AfterFork_Child hung as it was forked, a CPython bug (gh-112275) that `ddpkit doctor` "
    "warns of."
)


@dataclass
class StallReport:
    """What the watchdog found.

    Attributes:
        rank: the rank that made the report.
        kind: ``"deadlock"`` or ``"stall"``.
        headline: the first line.
        ranks: one line per rank saying where it is.
        advice: how to fix it.
        waited_s: how long the reporting rank had waited, in seconds.
        late_ranks: the ranks the others wait for (stall: the busy or silent ones).
        stacks: rank -> the Python stack of its training thread (missing when it did not answer).
    """

    rank: int
    world_size: int
    kind: str
    headline: str
    ranks: list[str] = field(default_factory=list)
    advice: str = ""
    waited_s: float = 0.0
    late_ranks: list[int] = field(default_factory=list)
    stacks: dict[int, str] = field(default_factory=dict)

    def text(self) -> str:
        lines = [self.headline, *(f"  {line}" for line in self.ranks)]
        if self.advice:
            lines.append(f"  {self.advice}")
        for rank in range(self.world_size):
            stack = self.stacks.get(rank)
            lines.append(f"  --- stack of rank {rank}'s training thread:")
            lines += [f"    {line}" for line in (stack or "(no answer)\n").rstrip().splitlines()]
        return "\n".join(lines)


def find_deadlock(positions: dict[int, Position], world_size: int) -> bool:
    """True when the ranks' positions can never all move on again.

    ``positions``: every rank's current position (a missing rank: no verdict). Only ranks
    blocked in a known collective or in backward count; one anywhere else (running, in a
    point-to-point call, creating a group) means no verdict.
    """
    if len(positions) < world_size:
        return False
    if any(p.state not in (COLLECTIVE, BACKWARD) for p in positions.values()):
        return False
    present: dict[tuple, set[int]] = defaultdict(set)
    for rank, position in positions.items():
        present[position.key].add(rank)
    for members in present.values():
        position = positions[min(members)]
        needed = set(position.ranks) if position.ranks else set(range(world_size))
        if needed <= members:  # this collective has everyone it needs: it can finish
            return False
    return True


def describe(position: Position, group_labels: dict[str, str] | None = None) -> str:
    """``all_reduce on the default group (ranks 0, 1), its collective #3, float32 (4,), called
    at train.py:12``; for running code ``running train.py:40 (in download)``."""
    if position.state == RUNNING and position.op == DATALOADER_WAIT:
        return f"waiting for a batch from its DataLoader's worker processes, at {position.site}"
    if position.state == RUNNING:
        return f"running {position.site} (in {position.op})"
    if position.state == BACKWARD:
        what = "backward(), waiting for DDP's gradient all-reduce"
    else:
        what = position.outer_op + f" (in {position.op})" if position.outer_op else position.op
        if position.group:
            label = (group_labels or {}).get(position.group, f"group {position.group}")
            what += f" on {label} (ranks {_ranks(position.ranks)})"
        if position.seq is not None:
            what += f", its collective #{position.seq}"
        if position.tensor:
            what += f", {position.tensor}"
    if position.via:
        what += f", in ddpkit's {position.via}()"
    return f"{what}, called at {position.site or '?'}"


def _ranks(ranks: tuple[int, ...]) -> str:
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def deadlock_report(
    rank: int,
    positions: dict[int, Position],
    waited_s: float,
    group_labels: dict[str, str] | None = None,
    eval_batches: list[int] | None = None,
) -> StallReport:
    """The report of a deadlock seen by ``rank`` (every rank blocked for ``waited_s``).

    ``eval_batches``: every rank's batch count of the last uneven evaluation loader built
    (``build_eval_loader``), named as the cause when a rank is in a DDP forward's collective.
    """
    lines = [f"rank {r}: {describe(positions[r], group_labels)}" for r in sorted(positions)]
    return StallReport(
        rank=rank,
        world_size=len(positions),
        kind="deadlock",
        headline=(
            f"deadlock: the ranks wait in collectives that cannot match (for {waited_s:.0f} s, "
            f"found by rank {rank}):"
        ),
        ranks=lines,
        advice=_deadlock_advice(positions, eval_batches),
        waited_s=waited_s,
    )


def _deadlock_advice(positions: dict[int, Position], eval_batches: list[int] | None) -> str:
    forward = sorted(r for r, p in positions.items() if p.outer_op.startswith("DDP forward"))
    if not forward:
        return DEADLOCK_ADVICE
    who = ", ".join(map(str, forward))
    if eval_batches is not None:
        shards = ", ".join(f"rank {r} {n}" for r, n in enumerate(eval_batches))
        cause = (
            f"rank(s) {who} run a forward the others do not; if it is an evaluation pass, "
            f"because the evaluation shards are uneven (build_eval_loader batches: {shards})"
        )
    else:
        cause = (
            f"rank(s) {who} run a forward the others do not, usually because one rank has more "
            "batches (uneven evaluation shards or inputs) or skips a batch"
        )
    return DDP_FORWARD_ADVICE.format(cause=cause)


def stall_report(
    rank: int,
    world_size: int,
    mine: Position,
    waited_s: float,
    peers: dict[int, tuple[Position | None, float | None]],
    group_labels: dict[str, str] | None = None,
) -> StallReport:
    """The report of ``rank`` having waited ``waited_s`` in ``mine``.

    ``peers``: rank -> (its last position or ``None`` if never heard, seconds it has been
    silent or ``None`` if it is not).
    Late ranks are the ones not blocked in this same collective: running, elsewhere, silent.
    """
    lines = [f"rank {rank}: {describe(mine, group_labels)} (waiting {waited_s:.0f} s)"]
    late, elsewhere, loading = [], [], []
    for peer in sorted(peers):
        position, silent = peers[peer]
        if position is None:
            lines.append(f"rank {peer}: no heartbeat yet (not started, or without the watchdog)")
        elif silent is not None:
            lines.append(
                f"rank {peer}: silent for {silent:.0f} s (dead, unreachable, or blocked while "
                f"holding the GIL); last seen {describe(position, group_labels)}"
            )
        elif position.key == mine.key:
            lines.append(f"rank {peer}: waiting in the same collective")
            continue
        elif position.state == RUNNING:
            lines.append(f"rank {peer}: busy, {describe(position, group_labels)}")
            if position.op == DATALOADER_WAIT:
                loading.append(peer)
        else:
            lines.append(f"rank {peer}: waiting elsewhere: {describe(position, group_labels)}")
            elsewhere.append(peer)
        late.append(peer)
    names = ", ".join(map(str, late)) or "none: every rank is in this collective"
    advice = STALL_ADVICE
    if not late:
        advice = (
            "Every rank is inside this collective and it does not finish: the network or the "
            "backend is stuck; see the stacks."
        )
    elif loading == late:  # every late rank waits for its DataLoader's workers
        advice = DATALOADER_ADVICE.format(names=names)
    elif elsewhere == late:  # nobody busy: blocked in code the watchdog cannot match
        advice = (
            f"Rank(s) {names} wait in other torch.distributed code, not in this collective: the "
            "ranks are most likely in different collectives (DDP's forward has its own: the "
            "bucket rebuild after the first step, the buffer broadcast). " + DEADLOCK_ADVICE
        )
    return StallReport(
        rank=rank,
        world_size=world_size,
        kind="stall",
        headline=(
            f"stall: rank {rank} waited {waited_s:.0f} s in {mine.outer_op or mine.op} at "
            f"{mine.site or '?'}; late rank(s): {names}"
        ),
        ranks=lines,
        advice=advice,
        waited_s=waited_s,
        late_ranks=late,
    )
