"""Healing a replacement from a live peer: the training state, sent over the new quorum's
process group (torch's own collectives), never read from a checkpoint."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ddpkit.errors import ConfigError
from ddpkit.live.protocol import Quorum


def transfer_state(
    quorum: Quorum,
    me: str,
    source: Callable[[], dict[str, Any]] | None,
    local: Callable[[], Any] | None,
    sink: Callable[[dict[str, Any], list[Any], int], None] | None,
) -> float:
    """Send the state of rank 0 (a survivor: they come first in ``quorum``) to the quorum's
    replacements; returns the seconds it took.

    Rank 0's ``source()`` (the ``CheckpointManager``'s state, as a checkpoint holds it) is
    broadcast (``broadcast_object_list``), every survivor's ``local()`` (its RNG states) is
    all-gathered, and each replacement's ``sink(payload, rng_by_rank, its rank)`` loads them.

    Collective over ``quorum``'s group (survivors and replacements alike).

    Raises:
        ConfigError: no state registered (the job built no ``CheckpointManager``).
        RuntimeError: a member was lost during the transfer (gloo's error).
    """
    start = time.monotonic()
    joining = me in quorum.joiners
    if quorum.rank_of(me) == 0 and source is None:
        raise ConfigError(
            "live fault tolerance: a replacement needs the job's state and this member has "
            "none registered. Build a CheckpointManager(state=...) (it registers its state for "
            "healing) before the first training step."
        )
    payload = [source() if quorum.rank_of(me) == 0 and source is not None else None]
    dist.broadcast_object_list(payload, group_src=0)
    rng_by_rank: list[Any] = [None] * len(quorum.members)
    dist.all_gather_object(rng_by_rank, None if joining or local is None else local())
    if joining:
        if sink is None:
            raise ConfigError(
                "live fault tolerance: a replacement received the job's state but has nothing "
                "to load it into. Build a CheckpointManager(state=...) and call its resume() "
                "before the first training step."
            )
        sink(payload[0], rng_by_rank, quorum.rank_of(me))
    return time.monotonic() - start
