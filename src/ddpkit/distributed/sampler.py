"""Sharded data loading: training shards whose epoch advances by itself, exact evaluation shards.

Training uses torch's ``DistributedSampler`` (same seed on every rank, disjoint shards, padded so
every rank has the same number of batches and no rank waits on a collective that never comes).
Evaluation uses :class:`UnpaddedDistributedSampler`, which gives each sample to exactly one rank,
so global metrics count every sample once whatever the world size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import torch
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


class ResumableDistributedSampler(DistributedSampler):
    """torch's ``DistributedSampler`` that can start its next pass part-way into the shard.

    ``start_index`` (set by :meth:`ShardedLoader.load_state_dict`) drops that many of this
    rank's indices from the next pass only; the permutation itself is torch's, unchanged.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.start_index = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        start, self.start_index = self.start_index, 0
        return iter(indices[start:])

    def __len__(self) -> int:
        return self.num_samples - self.start_index


class ShardedLoader:
    """A ``DataLoader`` over this rank's shard whose sampler epoch advances on every ``iter()``.

    The n-th pass over the loader (counting from 0) uses epoch ``start_epoch + n``, so each epoch
    has a new order and the ranks stay in step without a ``set_epoch`` call. Use
    :meth:`set_epoch` to jump, and :meth:`state_dict`/:meth:`load_state_dict` to resume exactly
    in the middle of an epoch (every remaining sample of that epoch seen once, none twice).

    Attributes:
        loader: the wrapped ``torch.utils.data.DataLoader``.
        sampler: its :class:`ResumableDistributedSampler`.
        epoch: the epoch the next pass will use.
        max_batches: a pass ends after this many batches (``None``: the whole shard).
    """

    def __init__(
        self,
        loader: DataLoader,
        sampler: ResumableDistributedSampler,
        start_epoch: int = 0,
        max_batches: int | None = None,
    ):
        self.loader = loader
        self.sampler = sampler
        self.epoch = start_epoch
        self.max_batches = max_batches
        self._skip_batches = 0
        self._in_progress: list[int] | None = None  # [epoch, batches consumed] of the open pass
        self._pass_generator_state: torch.Tensor | None = None

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass use ``epoch``."""
        self.epoch = epoch

    def __len__(self) -> int:
        """Batches in one full pass (the whole shard, capped by ``max_batches``)."""
        batch_size = self.loader.batch_size or 1
        samples = self.sampler.num_samples
        full = samples // batch_size if self.loader.drop_last else math.ceil(samples / batch_size)
        return min(full, self.max_batches) if self.max_batches else full

    @property
    def batches_done(self) -> int:
        """Batches of the current pass consumed so far, counting those skipped by a resume."""
        return self._in_progress[1] if self._in_progress is not None else 0

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "batches_done", "generator"}``: where the next batch would come from.

        A pass whose last batch was handed out counts as finished (the next epoch, 0 batches).
        Mid-pass, the generator state is the one from before the pass began, so the resumed pass
        draws the same worker seed again.
        """
        generator = self.loader.generator.get_state()
        if self._in_progress is None:  # between passes (or loaded and not yet iterated)
            return {"epoch": self.epoch, "batches_done": self._skip_batches, "generator": generator}
        epoch, done = self._in_progress
        if done >= len(self):
            return {"epoch": epoch + 1, "batches_done": 0, "generator": generator}
        return {"epoch": epoch, "batches_done": done, "generator": self._pass_generator_state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next pass resume epoch ``state["epoch"]`` after ``batches_done`` batches."""
        self.epoch = int(state["epoch"])
        self._skip_batches = int(state["batches_done"])
        self.loader.generator.set_state(state["generator"])

    def __iter__(self) -> Iterator[Any]:
        epoch, skip, per_pass = self.epoch, self._skip_batches, len(self)
        self.sampler.set_epoch(epoch)
        self.sampler.start_index = skip * (self.loader.batch_size or 1)
        self.epoch, self._skip_batches = epoch + 1, 0
        self._pass_generator_state = self.loader.generator.get_state()
        self._in_progress = [epoch, skip]
        try:
            if skip >= per_pass:
                return
            for batch in self.loader:
                self._in_progress[1] += 1
                yield batch
                if self._in_progress[1] >= per_pass:
                    return
        finally:  # exhausted, capped, or the caller broke out: the pass is over either way
            self._in_progress = None


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
    max_batches: int | None = None,
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
        max_batches: end every pass after this many batches (``None``: the whole shard).
        **loader_kwargs: passed to ``DataLoader`` (``num_workers``, ``pin_memory``, ...).

    Raises:
        ConfigError: ``batch_size`` is not a positive integer, or the dataset is empty.
    """
    batch_size = _check_batch_size(batch_size)
    if len(dataset) == 0:  # type: ignore[arg-type]
        raise ConfigError("empty dataset: len(dataset)=0. Check the data path.")
    sampler = ResumableDistributedSampler(
        dataset,
        num_replicas=runtime.world_size,
        rank=runtime.rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
    # The loader's own generator: creating an iterator draws a seed from it (for worker
    # processes), which would otherwise consume the global RNG once per epoch.
    loader_kwargs.setdefault("generator", torch.Generator().manual_seed(seed))
    loader = DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **loader_kwargs
    )
    return ShardedLoader(loader, sampler, max_batches=max_batches)


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
