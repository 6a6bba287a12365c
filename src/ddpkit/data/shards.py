"""The samplers behind ddpkit's loaders: resumable training shards, contiguous evaluation shards.

:class:`ResumableDistributedSampler` is torch's ``DistributedSampler`` whose pass can start
part-way into the epoch on any number of ranks; :class:`UnpaddedDistributedSampler` gives each
evaluation sample to exactly one rank, in contiguous blocks (dataset order, rank-major).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DistributedSampler, Sampler

from ddpkit.errors import ConfigError

__all__ = ["ResumableDistributedSampler", "UnpaddedDistributedSampler"]


class UnpaddedDistributedSampler(Sampler[int]):
    """Rank ``r`` of ``n`` gets one contiguous block of the indices, in order; nothing repeated.

    The blocks are ``numpy.array_split``'s: the first ``len % n`` ranks get one index more, so
    shards differ in length by at most one sample and rank-major concatenation is dataset
    order (``torch.cat(ddpkit.all_gather(preds, rt))`` lines up with the dataset's labels). Use
    it only where no collective runs per batch (evaluation with the unwrapped model does not).

    Args:
        dataset_len: number of samples in the dataset.
        world_size: the number of ranks (what torch's samplers call ``num_replicas``).
        rank: this process's rank.

    Example:
        >>> [list(UnpaddedDistributedSampler(7, world_size=3, rank=r)) for r in range(3)]
        [[0, 1, 2], [3, 4], [5, 6]]
    """

    def __init__(self, dataset_len: int, *, world_size: int, rank: int) -> None:
        if not 0 <= rank < world_size:
            raise ConfigError(f"invalid shard: rank={rank} not in [0, world_size={world_size}).")
        self.dataset_len = dataset_len
        self.reshard(world_size=world_size, rank=rank)

    def reshard(self, *, world_size: int, rank: int) -> None:
        """Take rank ``rank``'s block of ``world_size`` (live fault tolerance: the members
        changed)."""
        base, extra = divmod(self.dataset_len, world_size)
        start = rank * base + min(rank, extra)
        self.indices = range(start, start + base + (rank < extra))
        self.world_size = world_size

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class ResumableDistributedSampler(DistributedSampler):
    """torch's ``DistributedSampler`` whose next pass can resume part-way into the epoch, on any
    number of ranks.

    An epoch is a sequence of global positions: position ``p`` holds index ``order[p % N]``, with
    ``order`` torch's permutation of the epoch (from ``seed + epoch``) and ``N`` the dataset
    length, so positions past ``N`` repeat the first indices exactly as torch pads. torch gives
    rank ``r`` of ``W`` the positions ``r, r + W, ...`` below its ``total_size``. ``span = (start,
    end)`` (set by :meth:`ShardedLoader.__iter__`) makes the next pass take positions ``start + r,
    start + r + W, ...`` below ``end`` instead: at the world size that wrote ``start`` this is
    torch's shard without its first ``start / W`` indices, bitwise; at another world size it
    re-shards the rest of the epoch among the new ranks.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.span: tuple[int, int] | None = None

    def reshard(self, *, num_replicas: int, rank: int) -> None:
        """Deal the epoch to ``num_replicas`` ranks from the next pass on, this one being
        ``rank`` (live fault tolerance: the members changed). Sizes as torch computes them."""
        self.num_replicas, self.rank = num_replicas, rank
        length = len(self.dataset)  # type: ignore[arg-type]
        if self.drop_last and length % num_replicas != 0:
            self.num_samples = math.ceil((length - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(length / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def epoch_order(self) -> list[int]:
        """The epoch's permutation of every index, unpadded: torch's own, drawn by a one-replica
        ``DistributedSampler`` with this sampler's seed, shuffle and epoch."""
        whole: DistributedSampler[int] = DistributedSampler(
            self.dataset, num_replicas=1, rank=0, shuffle=self.shuffle, seed=self.seed
        )
        whole.set_epoch(self.epoch)
        return list(whole)

    def __iter__(self) -> Iterator[int]:
        span, self.span = self.span, None
        if span is None:
            return super().__iter__()
        order = self.epoch_order()
        start, end = span
        return iter(
            [order[p % len(order)] for p in range(start + self.rank, end, self.num_replicas)]
        )

    def __len__(self) -> int:
        if self.span is None:
            return self.num_samples
        start, end = self.span
        return len(range(start + self.rank, end, self.num_replicas))
