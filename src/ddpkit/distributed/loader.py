"""The training loader: one pass per ``iter()``, epoch advanced, resumable, seeded per rank.

Built by :func:`ddpkit.build_train_loader`; see :mod:`ddpkit.distributed.seeding` for how the
shuffle stays shared while augmentation randomness differs per rank and worker.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler

from ddpkit.distributed.seeding import (
    main_process_batch_seed,
    main_process_data_rng,
    worker_base_seed,
)
from ddpkit.distributed.streams import ShardedStream, stream_batches_per_rank, stream_length
from ddpkit.errors import ConfigError
from ddpkit.log import get_logger

log = get_logger("data")
_END = object()


class ShardedLoader:
    """A ``DataLoader`` over this rank's shard whose sampler epoch advances on every ``iter()``.

    The n-th pass over the loader (counting from 0) uses epoch ``start_epoch + n``, so each epoch
    has a new order and the ranks stay in step without a ``set_epoch`` call. Use
    :meth:`set_epoch` to jump, and :meth:`state_dict`/:meth:`load_state_dict` to resume exactly
    in the middle of an epoch (every remaining sample of that epoch seen once, none twice).

    Randomness: the order comes from ``seed + epoch`` (the same on every rank); augmentation
    draws come from ``(seed, rank, epoch)`` for worker processes and ``(seed, rank, epoch,
    batch)`` for main-process loading (see :mod:`ddpkit.distributed.seeding`), so they differ
    across ranks and workers and repeat on a rerun or resume.

    Attributes:
        loader: the wrapped ``torch.utils.data.DataLoader``.
        sampler: its ``DistributedSampler`` (``None`` for a stream).
        stream: the :class:`~ddpkit.distributed.streams.ShardedStream` (``None`` for a
            map-style dataset).
        epoch: the epoch the next pass will use.
        max_batches: a pass ends after this many batches (``None``: the whole shard).
        rank_batch_sizes: every rank's batch size, by rank (checked at build time).
        rank_num_batches: every rank's batches per pass, by rank (``None``: a stream of
            unknown length).
        sample_weighted: set by :class:`~ddpkit.GradientAccumulator`, which weighs every sample
            equally; a plain loop is warned (once) when batch sizes differ across ranks.
    """

    def __init__(
        self,
        loader: DataLoader,
        sampler: DistributedSampler | None,
        *,
        seed: int,
        rank: int,
        stream: ShardedStream | None = None,
        start_epoch: int = 0,
        max_batches: int | None = None,
    ):
        self.loader = loader
        self.sampler = sampler
        self.stream = stream
        self.seed = seed
        self.rank = rank
        self.epoch = start_epoch
        self.max_batches = max_batches
        self.rank_batch_sizes = [loader.batch_size or 1]
        self.rank_num_batches: list[int] | None = None
        self.sample_weighted = False
        self._warned = False
        self._skip_batches = 0
        self._in_progress: list[int] | None = None  # [epoch, batches consumed] of the open pass

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass use ``epoch``."""
        self.epoch = epoch

    def full_pass_batches(self) -> int | None:
        """Batches in one whole pass before ``max_batches``; ``None`` for a stream without
        ``__len__``."""
        batch_size = self.loader.batch_size or 1
        if self.sampler is not None:
            samples = self.sampler.num_samples
            if self.loader.drop_last:
                return samples // batch_size
            return math.ceil(samples / batch_size)
        assert self.stream is not None
        length = stream_length(self.stream.source)
        if length is None:
            return None
        return stream_batches_per_rank(
            length, self.stream.world_size, self.loader.num_workers, batch_size,
            self.loader.drop_last,
        )  # fmt: skip

    def __len__(self) -> int:
        """Batches in one full pass (the whole shard, capped by ``max_batches``).

        Raises:
            TypeError: a stream without ``__len__`` and no ``max_batches``.
        """
        full = self.full_pass_batches()
        if full is None:
            if self.max_batches:
                return self.max_batches
            raise TypeError(
                f"len(ShardedLoader): the stream {type(self.stream.source).__name__} has no "
                "__len__, so its batches per pass are known only when the pass ends. Give it a "
                "__len__, or pass max_batches."
            )
        return min(full, self.max_batches) if self.max_batches else full

    @property
    def same_batch_sizes(self) -> bool:
        """Every rank's i-th batch has the same size (equal batch sizes, equal shards)."""
        return len(set(self.rank_batch_sizes)) == 1

    @property
    def batches_done(self) -> int:
        """Batches of the current pass consumed so far, counting those skipped by a resume."""
        return self._in_progress[1] if self._in_progress is not None else 0

    def _pass_length(self) -> int | None:
        try:
            return len(self)
        except TypeError:
            return None

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "batches_done"}``: where the next batch would come from (the same on every
        rank). A pass whose last batch was handed out counts as finished (the next epoch, 0
        batches). Worker seeds are derived again from the epoch, so no generator is stored."""
        if self._in_progress is None:  # between passes (or loaded and not yet iterated)
            return {"epoch": self.epoch, "batches_done": self._skip_batches}
        epoch, done = self._in_progress
        per_pass = self._pass_length()
        if per_pass is not None and done >= per_pass:
            return {"epoch": epoch + 1, "batches_done": 0}
        return {"epoch": epoch, "batches_done": done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next pass resume epoch ``state["epoch"]`` after ``batches_done`` batches.

        A ``"generator"`` entry (checkpoints of ddpkit before 0.2) is ignored.
        """
        self.epoch = int(state["epoch"])
        self._skip_batches = int(state["batches_done"])

    def __iter__(self) -> Iterator[Any]:
        epoch, skip, per_pass = self.epoch, self._skip_batches, self._pass_length()
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)
            self.sampler.start_index = skip * (self.loader.batch_size or 1)
        else:
            self.stream.begin_pass(epoch, skip)
        self.loader.generator.manual_seed(worker_base_seed(self.seed, self.rank, epoch))
        self.epoch, self._skip_batches = epoch + 1, 0
        self._in_progress = [epoch, skip]
        self._warn_batch_sizes_once()
        try:
            if per_pass is not None and skip >= per_pass:
                return
            batches = iter(self.loader)
            while per_pass is None or self._in_progress[1] < per_pass:
                batch = self._next_batch(batches, epoch, self._in_progress[1])
                if batch is _END:
                    break
                self._in_progress[1] += 1
                yield batch
            if self._in_progress[1] == 0:
                raise self._empty_pass_error()
        finally:  # exhausted, capped, or the caller broke out: the pass is over either way
            self._in_progress = None

    def _next_batch(self, batches: Iterator[Any], epoch: int, index: int) -> Any:
        if self.loader.num_workers > 0:  # workers were seeded from the loader's generator
            return next(batches, _END)
        with main_process_data_rng(main_process_batch_seed(self.seed, self.rank, epoch, index)):
            return next(batches, _END)

    def _empty_pass_error(self) -> ConfigError:
        stream = self.stream
        assert stream is not None  # map-style loaders with no batch are refused when built
        num_workers = max(self.loader.num_workers, 1)
        return ConfigError(
            f"empty pass: the stream {type(stream.source).__name__} gave rank {self.rank} no "
            f"batch: world_size={stream.world_size}, num_workers={self.loader.num_workers}, "
            f"batch_size={self.loader.batch_size}, drop_last={self.loader.drop_last}. Each of "
            f"the {stream.world_size * num_workers} (rank, worker) slots needs "
            f"{'a full batch' if self.loader.drop_last else 'an item'}; use a smaller "
            "batch_size, drop_last=False, fewer workers or fewer processes."
        )

    def _warn_batch_sizes_once(self) -> None:
        """Warn once (rank 0; every rank knows every rank's sizes from the build-time check)."""
        if self._warned or self.rank != 0 or self.same_batch_sizes:
            return
        self._warned = True
        sizes, counts = self.rank_batch_sizes, self.rank_num_batches
        uneven = counts is not None and len(set(counts)) > 1
        parts = []
        if not self.sample_weighted:
            parts.append(
                f"in a plain loop DDP averages the ranks' mean losses, so a sample in a batch "
                f"of {min(sizes)} weighs {max(sizes) / min(sizes):.3g}x one in a batch of "
                f"{max(sizes)} (ddpkit.GradientAccumulator weighs every sample equally)"
            )
        if uneven:
            parts.append(
                "the batches per pass differ ("
                + ", ".join(f"rank {r} {c}" for r, c in enumerate(counts))
                + "), so under DDP the rank with more waits in an all-reduce the others never "
                "join (ddpkit.join_uneven_inputs lets them finish)"
            )
        if parts:
            listing = ", ".join(f"rank {r} {b}" for r, b in enumerate(sizes))
            log.warning(
                "ranks use different batch sizes (%s): %s. Pass the same batch_size on every "
                "rank.", listing, "; and ".join(parts),
            )  # fmt: skip
