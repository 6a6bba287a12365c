"""Healing a replacement from a live peer: the training state, sent over the new quorum's
process group (torch's own collectives), never read from a checkpoint.

The state travels as ``torch.save`` bytes in a uint8 tensor and is read with
``torch.load(weights_only=True)`` (ddpkit's checkpoint allow-list,
:func:`ddpkit.security.safe_load.load_state_bytes`), not with torch's
``broadcast_object_list``, which unpickles anything: the quorum's gloo addresses come from a
store any local process can write, so the bytes a replacement receives are not trusted to be a
peer's.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.errors import ConfigError
from ddpkit.live.protocol import Quorum
from ddpkit.security.safe_load import load_state_bytes


def _to_tensor(obj: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _load(data: torch.Tensor, sender: str, unsafe_pickle: bool) -> Any:
    return load_state_bytes(data.numpy().tobytes(), Path(sender), unsafe_pickle=unsafe_pickle)


def broadcast_safely(obj: Any, *, unsafe_pickle: bool = False) -> Any:
    """Rank 0's ``obj`` on every rank of the default group, unpickled with the allow-list.

    Collective (two broadcasts: the size, int64; then the bytes, uint8). ``obj`` is read on
    rank 0 only.

    Raises:
        DataError: the bytes received need a global outside the allow-list (named).
    """
    data = _to_tensor(obj) if dist.get_rank() == 0 else torch.empty(0, dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    dist.broadcast(size, src=0)
    if dist.get_rank() != 0:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, src=0)
    return obj if dist.get_rank() == 0 else _load(data, "(the state rank 0 sent)", unsafe_pickle)


def all_gather_safely(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (index = rank), unpickled with the allow-list.

    Collective (an all-gather of the sizes, int64, then of the bytes padded to the longest).

    Raises:
        DataError: a rank's bytes need a global outside the allow-list (named).
    """
    data, world = _to_tensor(obj), dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64))
    longest = max(int(size.item()) for size in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return [
        obj
        if rank == dist.get_rank()
        else _load(chunk[: int(size.item())], f"(rank {rank})", False)
        for rank, (chunk, size) in enumerate(zip(gathered, sizes, strict=True))
    ]


def transfer_state(
    quorum: Quorum,
    me: str,
    source: Callable[[], dict[str, Any]] | None,
    local: Callable[[], Any] | None,
    sink: Callable[[dict[str, Any], list[Any], int], None] | None,
    *,
    unsafe_pickle: bool = False,
) -> float:
    """Send the state of rank 0 (a survivor: they come first in ``quorum``) to the quorum's
    replacements; returns the seconds it took.

    Rank 0's ``source()`` (the ``CheckpointManager``'s state, as a checkpoint holds it) is
    broadcast (:func:`broadcast_safely`), every survivor's ``local()`` (its RNG states) is
    all-gathered (:func:`all_gather_safely`), and each replacement's ``sink(payload,
    rng_by_rank, its rank)`` loads them. What a replacement receives is unpickled with the
    checkpoint allow-list unless ``unsafe_pickle`` (the ``CheckpointManager``'s setting).

    Collective over ``quorum``'s group (survivors and replacements alike).

    Raises:
        ConfigError: no state registered (the job built no ``CheckpointManager``).
        DataError: what arrived needs a global outside the allow-list (named).
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
    sent = source() if quorum.rank_of(me) == 0 and source is not None else None
    payload = broadcast_safely(sent, unsafe_pickle=unsafe_pickle)
    rng_by_rank = all_gather_safely(None if joining or local is None else local())
    if joining:
        if sink is None:
            raise ConfigError(
                "live fault tolerance: a replacement received the job's state but has nothing "
                "to load it into. Build a CheckpointManager(state=...) and call its resume() "
                "before the first training step."
            )
        sink(payload, rng_by_rank, quorum.rank_of(me))
    return time.monotonic() - start
