"""Streams (``IterableDataset``) sharded by rank x worker, even by construction like the sampler.

A stream has no indices to split, so every DataLoader worker of every rank reads the whole
stream and keeps its share: with ``S = world_size * num_workers`` slots, slot ``rank *
num_workers + worker`` keeps items ``slot, slot + S, slot + 2S, ...`` (each item in exactly one
slot). As ``DistributedSampler`` does with indices, the last incomplete row of ``S`` items is
padded with the stream's first items for training (every slot then holds the same number of
items, so every rank gets the same number of batches of the same sizes and DDP never waits on a
rank that ran out), or dropped with ``drop_last``. Evaluation keeps each item exactly once and
pads nothing (``evaluate`` runs no collective per batch).

The stream must yield the same items in the same order in every process (seed any shuffle
buffer from the epoch, which :meth:`ShardedStream.begin_pass` hands to the stream's own
``set_epoch`` when it has one), must not shard itself by rank or worker, and must be
re-iterable (``__iter__`` starts over) for the padding items.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from ddpkit.errors import DataError


class ShardedStream(IterableDataset):
    """This rank's share of ``source``, split again among the DataLoader's workers.

    Args:
        source: the whole stream, identical in every process.
        rank: this process's rank.
        world_size: number of ranks.
        pad: complete the last row of ``world_size * num_workers`` items with the stream's
            first items (training); ``False`` leaves it ragged (evaluation).
        drop_last: drop the last incomplete row instead (training with ``drop_last``).
        batch_size: samples per batch, to skip whole batches on a resumed pass.
    """

    def __init__(
        self,
        source: IterableDataset,
        rank: int,
        world_size: int,
        *,
        pad: bool,
        drop_last: bool,
        batch_size: int,
    ) -> None:
        self.source = source
        self.rank = rank
        self.world_size = world_size
        self.pad = pad
        self.drop_last = drop_last
        self.batch_size = batch_size
        self.skip_batches = 0

    def begin_pass(self, epoch: int, skip_batches: int) -> None:
        """Set the pass's epoch (forwarded to ``source.set_epoch`` if it exists) and how many of
        this rank's batches a resumed pass skips."""
        set_epoch = getattr(self.source, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        self.skip_batches = skip_batches

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        # The DataLoader takes batch k of a pass from worker k % num_workers, so batch j of a
        # whole pass comes from worker j % num_workers. A pass resumed after `skip` batches
        # starts again at worker 0: worker w then plays the part of worker (w + skip) % n and
        # skips the batches that part had handed out.
        part = (worker + self.skip_batches) % num_workers
        skipped = len(range(part, self.skip_batches, num_workers)) * self.batch_size
        items = self._slot_items(self.rank * num_workers + part, self.world_size * num_workers)
        return itertools.islice(items, skipped, None)

    def _slot_items(self, slot: int, num_slots: int) -> Iterator[Any]:
        """Item ``slot`` of each row of ``num_slots``; a row is handed out once it is complete,
        so the last, incomplete row can be padded or dropped."""
        mine, have, count = None, False, 0
        for count, item in enumerate(self.source, start=1):
            column = (count - 1) % num_slots
            if column == slot:
                mine, have = item, True
            if column == num_slots - 1:
                yield mine
                mine, have = None, False
        rest = count % num_slots
        if rest == 0 or self.drop_last:
            return
        if have:
            yield mine
        elif self.pad:  # as DistributedSampler: the first items again, cycling if very short
            yield self._item_at((slot - rest) % count, count)

    def _item_at(self, index: int, length: int) -> Any:
        for position, item in enumerate(self.source):
            if position == index:
                return item
        raise DataError(
            f"stream could not be read again: item {index} of {length} missing on the second "
            f"read of {type(self.source).__name__}. Padding the last row (so every rank gets "
            "the same number of batches) needs a stream whose __iter__ starts over; make it "
            "re-iterable or pass drop_last=True."
        )


def stream_length(source: IterableDataset) -> int | None:
    """``len(source)``, or ``None`` for a stream without a length (most streams)."""
    try:
        return len(source)  # type: ignore[arg-type]
    except TypeError:  # no __len__, or one that refuses
        return None


def stream_batches_per_rank(
    length: int, world_size: int, num_workers: int, batch_size: int, drop_last: bool
) -> int:
    """Batches one rank gets from a stream of ``length`` items (see :class:`ShardedStream`)."""
    workers = max(num_workers, 1)
    num_slots = world_size * workers
    if drop_last:
        return (length // num_slots) // batch_size * workers
    return math.ceil(math.ceil(length / num_slots) / batch_size) * workers
