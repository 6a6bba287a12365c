"""Sharded data loading: training shards whose epoch advances by itself, exact evaluation shards.

Training uses torch's ``DistributedSampler`` (same seed on every rank, disjoint shards, padded so
every rank has the same number of batches and no rank waits on a collective that never comes).
Evaluation uses :class:`UnpaddedDistributedSampler`, which gives each sample to exactly one rank,
so global metrics count every sample once whatever the world size.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from ddpkit.distributed.process_group import Runtime
from ddpkit.errors import ConfigError


class UnpaddedDistributedSampler(Sampler[int]):
    """Rank ``r`` of ``n`` gets indices ``r, r+n, r+2n, ...`` in order; nothing is repeated.

    Shards differ in length by at most one sample, so use it only where no collective runs per
    batch (evaluation with the unwrapped model does not).

    Args:
        dataset_len: number of samples in the dataset.
        num_replicas: world size.
        rank: this process's rank.
    """

    def __init__(self, dataset_len: int, num_replicas: int, rank: int) -> None:
        if not 0 <= rank < num_replicas:
            raise ConfigError(
                f"invalid shard: rank={rank} not in [0, num_replicas={num_replicas})."
            )
        self.indices = range(rank, dataset_len, num_replicas)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class ShardedLoader:
    """A ``DataLoader`` over this rank's shard whose sampler epoch advances on every ``iter()``.

    The n-th pass over the loader (counting from 0) uses epoch ``start_epoch + n``, so each epoch
    has a new order and the ranks stay in step without a ``set_epoch`` call. Use
    :meth:`set_epoch` to jump (for example when resuming).

    Attributes:
        loader: the wrapped ``torch.utils.data.DataLoader``.
        sampler: its ``DistributedSampler``.
        epoch: the epoch the next pass will use.
    """

    def __init__(self, loader: DataLoader, sampler: DistributedSampler, start_epoch: int = 0):
        self.loader = loader
        self.sampler = sampler
        self.epoch = start_epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass use ``epoch``."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


def _check_batch_size(batch_size: object) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(
            f"invalid batch size: batch_size={batch_size!r}. It must be a positive integer "
            "(samples per rank per step)."
        )
    return batch_size


def build_train_loader(
    dataset: Dataset,
    runtime: Runtime,
    batch_size: int,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    **loader_kwargs: Any,
) -> ShardedLoader:
    """A training loader over this rank's shard of ``dataset``.

    Every rank must pass the same ``seed``: the shuffle permutation is drawn from
    ``seed + epoch`` and then split, so the shards are disjoint and together cover the data
    (``DistributedSampler`` pads the last few indices so the shards have equal length).

    Args:
        dataset: a map-style dataset with ``__len__``.
        runtime: the job's :class:`Runtime`.
        batch_size: samples per rank per step; the global batch is ``batch_size * world_size``.
        shuffle: reshuffle every epoch.
        seed: the shuffle seed, identical on every rank.
        drop_last: drop the tail so the shards are equal without padding.
        **loader_kwargs: passed to ``DataLoader`` (``num_workers``, ``pin_memory``, ...).

    Raises:
        ConfigError: ``batch_size`` is not a positive integer, or the dataset is empty.
    """
    batch_size = _check_batch_size(batch_size)
    if len(dataset) == 0:  # type: ignore[arg-type]
        raise ConfigError("empty dataset: len(dataset)=0. Check the data path.")
    sampler = DistributedSampler(
        dataset,
        num_replicas=runtime.world_size,
        rank=runtime.rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, **loader_kwargs)
    return ShardedLoader(loader, sampler)


def build_eval_loader(
    dataset: Dataset, runtime: Runtime, batch_size: int, **loader_kwargs: Any
) -> DataLoader:
    """An evaluation loader over this rank's unpadded shard: each sample on exactly one rank.

    Raises:
        ConfigError: ``batch_size`` is not a positive integer.
    """
    batch_size = _check_batch_size(batch_size)
    sampler = UnpaddedDistributedSampler(_len(dataset), runtime.world_size, runtime.rank)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, **loader_kwargs)


def _len(dataset: Dataset) -> int:
    if not isinstance(dataset, Sized):
        raise ConfigError("evaluation needs a map-style dataset with __len__.")
    return len(dataset)
