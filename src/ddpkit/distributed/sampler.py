"""Sharded data loading: training shards whose epoch advances by itself, exact evaluation shards.

Training uses torch's ``DistributedSampler`` (same seed on every rank, disjoint shards, padded so
every rank has the same number of batches and no rank waits on a collective that never comes).
Evaluation uses :class:`UnpaddedDistributedSampler`, which gives each sample to exactly one rank,
so global metrics count every sample once whatever the world size. Streams (``IterableDataset``)
are split by rank x worker the same two ways (:mod:`ddpkit.distributed.streams`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, Sampler

from ddpkit.distributed.collectives import all_gather_object
from ddpkit.distributed.loader import ShardedLoader
from ddpkit.distributed.process_group import Runtime
from ddpkit.distributed.streams import ShardedStream, stream_length
from ddpkit.errors import ConfigError

__all__ = [
    "ResumableDistributedSampler",
    "ShardedLoader",
    "UnpaddedDistributedSampler",
    "build_eval_loader",
    "build_train_loader",
]


class UnpaddedDistributedSampler(Sampler[int]):
    """Rank ``r`` of ``n`` gets indices ``r, r+n, r+2n, ...`` in order; nothing is repeated.

    Shards differ in length by at most one sample, so use it only where no collective runs per
    batch (evaluation with the unwrapped model does not).

    Args:
        dataset_len: number of samples in the dataset.
        world_size: the number of ranks (what torch's samplers call ``num_replicas``).
        rank: this process's rank.
    """

    def __init__(self, dataset_len: int, *, world_size: int, rank: int) -> None:
        if not 0 <= rank < world_size:
            raise ConfigError(f"invalid shard: rank={rank} not in [0, world_size={world_size}).")
        self.indices = range(rank, dataset_len, world_size)

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

    def epoch_order(self) -> list[int]:
        """The epoch's permutation of every index, unpadded: torch's own, drawn by a one-replica
        ``DistributedSampler`` with this sampler's seed, shuffle and epoch."""
        whole = DistributedSampler(
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


def _refuse_persistent_workers(loader_kwargs: dict) -> None:
    if loader_kwargs.get("persistent_workers"):
        raise ConfigError(
            "persistent_workers=True with a stream: persistent workers keep the stream "
            "object of the first pass, so later epochs and resumed passes would not reach "
            "them. Drop persistent_workers for an IterableDataset."
        )


def _check_batch_size(batch_size: object) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(
            f"invalid batch size: batch_size={batch_size!r}. It must be a positive integer "
            "(samples per rank per step)."
        )
    return batch_size


def _length(dataset: Dataset) -> int | None:
    """``len(dataset)``; ``None`` for a stream without one."""
    if isinstance(dataset, IterableDataset):
        return stream_length(dataset)
    if not isinstance(dataset, Sized):
        raise ConfigError(
            f"dataset without a length: {type(dataset).__name__} has no __len__. A map-style "
            "dataset needs __len__ (and __getitem__); a stream should subclass "
            "torch.utils.data.IterableDataset, which ddpkit shards by rank and worker."
        )
    return len(dataset)


def build_train_loader(
    dataset: Dataset,
    runtime: Runtime,
    *,
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
    Augmentation randomness (torch, numpy, ``random`` inside ``__getitem__``) differs per rank
    and worker and repeats on a rerun: workers are seeded from ``(seed, rank, epoch)``; with
    ``num_workers=0`` each batch is fetched under RNGs seeded from ``(seed, rank, epoch,
    batch)`` and the global RNG states are restored after it (so loading never shifts the
    training stream). A dataset that keeps its own generator should seed it from
    ``torch.initial_seed()`` inside ``__getitem__``, which torch sets per worker.

    The loader's position (``state_dict``) is global for a map-style dataset: a checkpoint
    resumes on any number of ranks, the rest of the epoch re-sharded, each remaining sample once
    (:class:`ResumableDistributedSampler`; keep the global batch with
    :func:`ddpkit.fit_global_batch`).

    A stream (``IterableDataset``) is split by rank x worker (every ``world_size *
    num_workers``-th item; :mod:`ddpkit.distributed.streams`), its last row padded with its
    first items (or dropped with ``drop_last``) so every rank gets the same number of batches.
    It is read whole by every worker, must yield the same items in the same order in every
    process (``shuffle`` does not apply; a ``set_epoch(epoch)`` method of the stream is called
    before each pass) and must not shard itself.

    Collective (world size > 1): call on every rank; one all-gather of the settings, which must
    agree (dataset length, seed, shuffle, drop_last; num_workers for a stream).

    Args:
        dataset: a map-style dataset with ``__len__``, or an ``IterableDataset``.
        runtime: the job's :class:`Runtime`.
        batch_size: samples per rank per step; the global batch is ``batch_size * world_size``.
            Different sizes across ranks are warned about at the first pass (see
            :class:`ShardedLoader`).
        shuffle: reshuffle every epoch.
        seed: the shuffle and augmentation seed, identical on every rank.
        drop_last: drop the tail so the shards are equal without padding.
        max_batches: end every pass after this many batches (``None``: the whole shard).
        **loader_kwargs: passed to ``DataLoader`` (``num_workers``, ``pin_memory``, ...);
            not ``generator``, which ddpkit seeds per rank and epoch.

    Raises:
        ConfigError (on every rank): ``batch_size`` is not a positive integer; the dataset is
            empty or has no ``__len__`` and is no stream; a pass would give a rank no batch
            (naming the dataset length, world size, batch size and drop_last); a ``generator``
            was passed; the settings differ across ranks (naming each rank's).

    Example:
        >>> loader = build_train_loader(train_set, rt, batch_size=64, seed=0,  # doctest: +SKIP
        ...                             num_workers=2)
    """
    loader, error = None, None
    try:
        loader = _build_local(dataset, runtime, batch_size, shuffle, seed, drop_last, max_batches,
                              loader_kwargs)  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - every rank must reach the settings exchange
        if runtime.process_group is None:
            raise
        error = exc
    settings = {
        "problem": None if error is None else f"{type(error).__name__}: {error}",
        "len(dataset)": None if loader is None else _length(dataset),
        "seed": seed,
        "shuffle": shuffle,
        "drop_last": drop_last,
        "batch_size": batch_size,
        "num_workers": loader_kwargs.get("num_workers", 0),
        "batches": None if loader is None or loader.full_pass_batches() is None else len(loader),
    }
    table = _agree_across_ranks(settings, runtime, isinstance(dataset, IterableDataset))
    if error is not None:
        raise error  # this rank's own, once every rank knows it (none waits in the exchange)
    assert loader is not None
    loader.rank_batch_sizes = [row["batch_size"] for row in table]
    counts = [row["batches"] for row in table]
    loader.rank_num_batches = counts if None not in counts else None
    return loader


def _build_local(
    dataset: Dataset,
    runtime: Runtime,
    batch_size: int,
    shuffle: bool,
    seed: int,
    drop_last: bool,
    max_batches: int | None,
    loader_kwargs: dict[str, Any],
) -> ShardedLoader:
    batch_size = _check_batch_size(batch_size)
    if "generator" in loader_kwargs:
        raise ConfigError(
            "build_train_loader: generator= is not accepted. ddpkit seeds the loader's "
            "generator from (seed, rank, epoch) so workers draw different augmentation on every "
            "rank; pass seed=... instead."
        )
    length = _length(dataset)
    if length == 0:
        raise ConfigError("empty dataset: len(dataset)=0. Check the data path.")
    generator = torch.Generator()  # reseeded per pass; never the global RNG
    if isinstance(dataset, IterableDataset):
        _refuse_persistent_workers(loader_kwargs)
        stream = ShardedStream(dataset, runtime.rank, runtime.world_size, pad=True,
                               drop_last=drop_last, batch_size=batch_size)  # fmt: skip
        torch_loader = DataLoader(stream, batch_size=batch_size, drop_last=drop_last,
                                  generator=generator, **loader_kwargs)  # fmt: skip
        sampler = None
    else:
        stream = None
        sampler = ResumableDistributedSampler(
            dataset, num_replicas=runtime.world_size, rank=runtime.rank, shuffle=shuffle,
            seed=seed, drop_last=drop_last,
        )  # fmt: skip
        torch_loader = DataLoader(
            dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
            generator=generator, **loader_kwargs,
        )  # fmt: skip
    loader = ShardedLoader(torch_loader, sampler, seed=seed, rank=runtime.rank, stream=stream,
                           max_batches=max_batches)  # fmt: skip
    if loader.full_pass_batches() == 0:
        per_rank = f" ({sampler.num_samples} samples per rank)" if sampler is not None else ""
        raise ConfigError(
            f"empty pass: len(dataset)={length}, world_size={runtime.world_size}, "
            f"batch_size={batch_size}, drop_last={drop_last}"
            + (f", num_workers={torch_loader.num_workers}" if stream is not None else "")
            + f" give each rank 0 batches{per_rank}. Every rank needs at least one batch per "
            "pass; use a smaller batch_size, drop_last=False, or fewer processes."
        )
    return loader


_MUST_AGREE = ("len(dataset)", "seed", "shuffle", "drop_last")


def _agree_across_ranks(
    settings: dict[str, Any], runtime: Runtime, stream: bool
) -> list[dict[str, Any]]:
    """Every rank's loader settings (one all-gather); raise on every rank when they disagree."""
    if runtime.process_group is None:
        return [settings]
    table = all_gather_object(settings, runtime)
    if settings["problem"] is not None:
        return table  # the caller raises this rank's own error
    for rank, row in enumerate(table):
        if row["problem"] is not None:
            raise ConfigError(
                f"build_train_loader failed on rank {rank}/{runtime.world_size}: {row['problem']}"
            )
    keys = _MUST_AGREE + (("num_workers",) if stream else ())
    differ = [key for key in keys if len({repr(row[key]) for row in table}) > 1]
    if differ:
        listing = "; ".join(
            f"{key}: " + ", ".join(f"rank {r} {row[key]!r}" for r, row in enumerate(table))
            for key in differ
        )
        raise ConfigError(
            f"train loader settings differ across ranks: {listing}. Every rank must build the "
            f"loader over the same data with the same {', '.join(keys)}, or the shards overlap "
            "and miss samples. Pass the same values on every rank."
        )
    return table


def build_eval_loader(
    dataset: Dataset, runtime: Runtime, *, batch_size: int, **loader_kwargs: Any
) -> DataLoader:
    """An evaluation loader over this rank's unpadded shard: each sample on exactly one rank.

    Map-style datasets use :class:`UnpaddedDistributedSampler`; a stream (``IterableDataset``)
    is split by rank x worker without padding. Shards may differ by a batch across ranks (even
    be empty on some), which :func:`ddpkit.evaluate` handles (no collective per batch).

    Raises:
        ConfigError: ``batch_size`` is not a positive integer; the dataset is empty or has no
            ``__len__`` and is no stream; ``drop_last=True`` (samples would be left out).
    """
    batch_size = _check_batch_size(batch_size)
    if loader_kwargs.get("drop_last"):
        raise ConfigError(
            "build_eval_loader: drop_last=True would leave samples out of the metrics. "
            "Evaluation counts every sample exactly once; drop the argument."
        )
    if isinstance(dataset, IterableDataset):
        _refuse_persistent_workers(loader_kwargs)
        stream = ShardedStream(dataset, runtime.rank, runtime.world_size, pad=False,
                               drop_last=False, batch_size=batch_size)  # fmt: skip
        return DataLoader(stream, batch_size=batch_size, **loader_kwargs)
    length = _length(dataset)
    if length == 0:
        raise ConfigError("empty evaluation dataset: len(dataset)=0. Check the data path.")
    sampler = UnpaddedDistributedSampler(length, world_size=runtime.world_size, rank=runtime.rank)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, **loader_kwargs)
