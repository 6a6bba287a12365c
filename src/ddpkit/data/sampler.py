"""Sharded data loading: training shards whose epoch advances by itself, exact evaluation shards.

Training uses torch's ``DistributedSampler`` (same seed on every rank, disjoint shards, padded so
every rank has the same number of batches and no rank waits on a collective that never comes).
Evaluation uses :class:`UnpaddedDistributedSampler`, which gives each sample to exactly one rank,
so global metrics count every sample once whatever the world size. Streams (``IterableDataset``)
are split by rank x worker the same two ways (:mod:`ddpkit.data.streams`).
"""

from __future__ import annotations

from collections.abc import Callable, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, WeightedRandomSampler

from ddpkit.data.fingerprint import dataset_fingerprint, describe, fingerprint_mismatch
from ddpkit.data.loader import ShardedLoader
from ddpkit.data.shards import ResumableDistributedSampler, UnpaddedDistributedSampler
from ddpkit.data.streams import ShardedStream, stream_length
from ddpkit.data.weighted import WeightedDistributedSampler, take_sampler
from ddpkit.errors import ConfigError
from ddpkit.runtime.collectives import all_gather_object
from ddpkit.runtime.process_group import Runtime

__all__ = [
    "ResumableDistributedSampler",
    "ShardedLoader",
    "UnpaddedDistributedSampler",
    "build_eval_loader",
    "build_train_loader",
]


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
    num_workers``-th item; :mod:`ddpkit.data.streams`), its last row padded with its
    first items (or dropped with ``drop_last``) so every rank gets the same number of batches.
    It is read whole by every worker, must yield the same items in the same order in every
    process (``shuffle`` does not apply; a ``set_epoch(epoch)`` method of the stream is called
    before each pass) and must not shard itself.

    Weighted sampling: pass ``sampler=torch.utils.data.WeightedRandomSampler(weights,
    num_samples)``; ``num_samples`` is per epoch over all ranks, drawn once from ``seed +
    epoch`` and split across the ranks (:class:`~ddpkit.data.weighted.
    WeightedDistributedSampler`), resumable like the rest. Any other ``sampler=`` or
    ``batch_sampler=`` is refused (ddpkit does the sharding).

    Collective (world size > 1): call on every rank; one all-gather of the settings, which must
    agree (dataset length, seed, shuffle, drop_last, the weighted sampler's weights; num_workers
    for a stream), and of the dataset's fingerprint (:mod:`ddpkit.data.fingerprint`:
    ``Subset`` indices, targets, sampled labels), so ranks that built different data (a
    per-rank seed before ``random_split``) are refused.

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
            not ``generator``, which ddpkit seeds per rank and epoch; ``sampler`` only a
            ``WeightedRandomSampler``.

    Raises:
        ConfigError (on every rank): ``batch_size`` is not a positive integer; the dataset is
            empty or has no ``__len__`` and is no stream; a pass would give a rank no batch
            (naming the dataset length, world size, batch size and drop_last); a ``generator``
            was passed; a ``sampler`` other than ``WeightedRandomSampler`` or a
            ``batch_sampler``; the settings differ across ranks (naming each rank's); the
            dataset's fingerprint differs (naming what differs and which ranks).

    Example:
        >>> loader = build_train_loader(train_set, rt, batch_size=4, seed=0, num_workers=2)
        >>> len(loader)  # batches per rank: 32 samples over 2 ranks
        4
    """
    loader_kwargs = dict(loader_kwargs)

    def build() -> ShardedLoader:
        weighted = take_sampler(dataset, loader_kwargs, "build_train_loader")
        return _build_local(
            dataset,
            runtime,
            batch_size,
            shuffle,
            seed,
            drop_last,
            max_batches,
            weighted,
            loader_kwargs,
        )

    loader, common, error = _local(build, dataset, runtime)
    sampler = None if loader is None else loader.sampler
    settings = {
        **common,
        "seed": seed,
        "shuffle": shuffle,
        "drop_last": drop_last,
        "batch_size": batch_size,
        "num_workers": loader_kwargs.get("num_workers", 0),
        "sampler": sampler.signature() if isinstance(sampler, WeightedDistributedSampler) else None,
        "batches": None if loader is None or loader.full_pass_batches() is None else len(loader),
    }
    keys = _MUST_AGREE + (("num_workers",) if isinstance(dataset, IterableDataset) else ())
    table = _agree_across_ranks(
        settings, runtime, keys, "build_train_loader", f"the train dataset ({describe(dataset)})"
    )
    if error is not None:
        raise error  # this rank's own, once every rank knows it (none waits in the exchange)
    assert loader is not None
    loader.rank_batch_sizes = [row["batch_size"] for row in table]
    counts = [row["batches"] for row in table]
    loader.rank_num_batches = counts if None not in counts else None
    if runtime.live is not None:  # the members change: deal the epoch to the new ones
        live = runtime.live
        if loader.sampler is None:
            loader.reshard(0, 1)  # raises the one-line error for a stream
        live.on_change.append(lambda quorum: loader.reshard(runtime.rank, runtime.world_size))
    return loader


def _local(
    build: Callable[[], Any], dataset: Dataset, runtime: Runtime
) -> tuple[Any, dict[str, Any], Exception | None]:
    """``(loader, settings, error)``: this rank's loader, built, and what both builders
    exchange about it (its problem, the length, the fingerprint, computed only where there is a
    peer to compare with). With peers a failure is returned, not raised, so that every rank
    reaches the exchange and hears it; alone it is raised."""
    try:
        loader = build()
        fingerprint = dataset_fingerprint(dataset) if runtime.process_group is not None else None
        return (
            loader,
            {"problem": None, "len(dataset)": _length(dataset), "dataset": fingerprint},
            None,
        )
    except Exception as exc:  # noqa: BLE001 - every rank must reach the settings exchange
        if runtime.process_group is None:
            raise
        problem = f"{type(exc).__name__}: {exc}"
        return None, {"problem": problem, "len(dataset)": None, "dataset": None}, exc


def _build_local(
    dataset: Dataset,
    runtime: Runtime,
    batch_size: int,
    shuffle: bool,
    seed: int,
    drop_last: bool,
    max_batches: int | None,
    weighted: WeightedRandomSampler | None,
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
        stream = ShardedStream(
            dataset,
            runtime.rank,
            runtime.world_size,
            pad=True,
            drop_last=drop_last,
            batch_size=batch_size,
        )
        torch_loader = DataLoader(
            stream, batch_size=batch_size, drop_last=drop_last, generator=generator, **loader_kwargs
        )
        sampler = None
    else:
        stream = None
        sampler = _train_sampler(dataset, runtime, shuffle, seed, drop_last, weighted)
        torch_loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            drop_last=drop_last,
            generator=generator,
            **loader_kwargs,
        )
    loader = ShardedLoader(
        torch_loader, sampler, seed=seed, rank=runtime.rank, stream=stream, max_batches=max_batches
    )
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


def _train_sampler(
    dataset: Dataset,
    runtime: Runtime,
    shuffle: bool,
    seed: int,
    drop_last: bool,
    weighted: WeightedRandomSampler | None,
) -> ResumableDistributedSampler:
    shard: dict[str, Any] = {
        "num_replicas": runtime.world_size,
        "rank": runtime.rank,
        "seed": seed,
        "drop_last": drop_last,
    }
    if weighted is not None:
        return WeightedDistributedSampler(weighted, **shard)
    return ResumableDistributedSampler(dataset, shuffle=shuffle, **shard)


_MUST_AGREE = ("len(dataset)", "seed", "shuffle", "drop_last", "sampler")


def _agree_across_ranks(
    settings: dict[str, Any], runtime: Runtime, keys: tuple[str, ...], who: str, what: str
) -> list[dict[str, Any]]:
    """Every rank's loader settings (one all-gather); raise on every rank when they disagree:
    a rank's own build problem, one of ``keys``, or the dataset fingerprint (``what`` names
    the dataset)."""
    if runtime.process_group is None:
        return [settings]
    table = all_gather_object(settings, runtime)
    if settings["problem"] is not None:
        return table  # the caller raises this rank's own error
    for rank, row in enumerate(table):
        if row["problem"] is not None:
            raise ConfigError(f"{who} failed on rank {rank}/{runtime.world_size}: {row['problem']}")
    differ = [key for key in keys if len({repr(row[key]) for row in table}) > 1]
    if differ:
        listing = "; ".join(
            f"{key}: " + ", ".join(f"rank {r} {row[key]!r}" for r, row in enumerate(table))
            for key in differ
        )
        raise ConfigError(
            f"{who.removeprefix('build_').replace('_', ' ')} settings differ across ranks: "
            f"{listing}. Every rank must build the "
            f"loader over the same data with the same {', '.join(keys)}, or the shards overlap "
            "and miss samples. Pass the same values on every rank."
        )
    mismatch = fingerprint_mismatch(
        [row["dataset"] for row in table], what, getattr(runtime, "str_hashes_agree", None)
    )
    if mismatch is not None:
        raise ConfigError(mismatch)
    return table


def build_eval_loader(
    dataset: Dataset, runtime: Runtime, *, batch_size: int, **loader_kwargs: Any
) -> DataLoader:
    """An evaluation loader over this rank's unpadded shard: each sample on exactly one rank.

    Map-style datasets use :class:`UnpaddedDistributedSampler`: contiguous blocks in rank
    order, so ``torch.cat(ddpkit.all_gather(preds, rt))`` of the predictions made over this
    loader is in dataset order. A stream (``IterableDataset``) is split by rank x worker
    without padding (rank-major concatenation is then not stream order). Shards may differ by
    a batch across ranks (even be empty on some), which :func:`ddpkit.evaluate` handles (no
    collective per batch); every rank knows every rank's batch count
    (``loader.rank_num_batches``).

    Collective (world size > 1): call on every rank; one all-gather of the length, the batch
    count and the dataset fingerprint (:mod:`ddpkit.data.fingerprint`), which must agree.

    Raises:
        ConfigError (on every rank): ``batch_size`` is not a positive integer; the dataset is
            empty or has no ``__len__`` and is no stream; ``drop_last=True`` (samples would be
            left out); a ``sampler=`` or ``batch_sampler=``; the ranks built different data.
    """
    loader_kwargs = dict(loader_kwargs)
    loader, common, error = _local(
        lambda: _build_eval_local(dataset, runtime, batch_size, loader_kwargs), dataset, runtime
    )
    sized = loader is not None and not isinstance(dataset, IterableDataset)
    settings = {**common, "batches": len(loader) if sized else None}
    table = _agree_across_ranks(
        settings,
        runtime,
        ("len(dataset)",),
        "build_eval_loader",
        f"the evaluation dataset ({describe(dataset)})",
    )
    if error is not None:
        raise error
    assert loader is not None
    counts = [row["batches"] for row in table]
    loader.rank_num_batches = counts
    if runtime.live is not None:
        _follow_quorums(loader, runtime)
    if runtime.watchdog is not None:  # a deadlock in a DDP forward names uneven eval shards
        uneven = None not in counts and len(set(counts)) > 1
        runtime.watchdog.eval_batches = counts if uneven else None
    return loader


def _follow_quorums(loader: DataLoader, runtime: Runtime) -> None:
    """Live fault tolerance: the evaluation shards follow the members (each sample on exactly
    one of them)."""
    sampler = loader.sampler
    if not isinstance(sampler, UnpaddedDistributedSampler):
        raise ConfigError(
            "live fault tolerance with a stream (IterableDataset) to evaluate: its shards "
            "cannot follow the members. Use a map-style dataset (__len__ and __getitem__)."
        )

    def reshard(quorum: object) -> None:
        size = runtime.world_size
        sampler.reshard(world_size=size, rank=runtime.rank)
        batch = loader.batch_size or 1
        loader.rank_num_batches = [
            -(
                -len(UnpaddedDistributedSampler(sampler.dataset_len, world_size=size, rank=r))
                // batch
            )
            for r in range(size)
        ]

    assert runtime.live is not None
    runtime.live.on_change.append(reshard)


def _build_eval_local(
    dataset: Dataset, runtime: Runtime, batch_size: int, loader_kwargs: dict[str, Any]
) -> DataLoader:
    batch_size = _check_batch_size(batch_size)
    if loader_kwargs.get("drop_last"):
        raise ConfigError(
            "build_eval_loader: drop_last=True would leave samples out of the metrics. "
            "Evaluation counts every sample exactly once; drop the argument."
        )
    take_sampler(dataset, loader_kwargs, "build_eval_loader")
    if isinstance(dataset, IterableDataset):
        _refuse_persistent_workers(loader_kwargs)
        stream = ShardedStream(
            dataset,
            runtime.rank,
            runtime.world_size,
            pad=False,
            drop_last=False,
            batch_size=batch_size,
        )
        return DataLoader(stream, batch_size=batch_size, **loader_kwargs)
    length = _length(dataset)
    assert length is not None  # None only for a stream, handled above
    if length == 0:
        raise ConfigError("empty evaluation dataset: len(dataset)=0. Check the data path.")
    sampler = UnpaddedDistributedSampler(length, world_size=runtime.world_size, rank=runtime.rank)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, **loader_kwargs)
