"""The training loader: one pass per ``iter()``, epoch advanced, resumable, seeded per rank.

Built by :func:`ddpkit.build_train_loader`; see :mod:`ddpkit.data.seeding` for how the
shuffle stays shared while augmentation randomness differs per rank and worker. Its position in
an epoch is global (samples done over all ranks), so a checkpoint resumes on any number of ranks
(:class:`~ddpkit.data.shards.ResumableDistributedSampler` deals out the rest).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader

from ddpkit.data.seeding import (
    main_process_batch_seed,
    main_process_data_rng,
    worker_base_seed,
)
from ddpkit.data.shards import ResumableDistributedSampler
from ddpkit.data.streams import ShardedStream, stream_batches_per_rank, stream_length
from ddpkit.errors import ConfigError
from ddpkit.log import get_logger

log = get_logger("data")
_END = object()


@dataclass
class _Pass:
    """One pass: its epoch, this rank's batch count, and the global positions it covers.

    Attributes:
        first: this rank's batches of the epoch before the pass (a resumed pass), which numbers
            the seeds of main-process loading.
        num_batches: batches the pass yields on this rank (``None``: a stream of unknown length).
        start, end: the epoch's global positions ``[start, end)`` it covers (map-style only).
        done: batches handed out so far.
        world_size: the ranks the pass is dealt to (a re-shard during the pass, live fault
            tolerance's, applies to the next pass only).
    """

    epoch: int
    first: int
    num_batches: int | None
    start: int = 0
    end: int = 0
    done: int = 0
    world_size: int = 1


def resumed_end(start: int, epoch_end: int, world_size: int, drop_last: bool) -> int:
    """Where a pass resumed at global position ``start`` ends on ``world_size`` ranks.

    The positions left, ``[start, epoch_end)``, are completed to a whole row of ``world_size``
    (the padding positions repeat the epoch's first indices, as ``DistributedSampler`` pads) or,
    with ``drop_last``, cut to one, so every rank's shard has the same length. At the world size
    that wrote ``start`` the positions left already fill whole rows: ``epoch_end`` comes back.
    """
    rest = max(epoch_end - start, 0)
    rows = rest // world_size if drop_last else -(-rest // world_size)
    return start + rows * world_size


def pass_batches(
    start: int, end: int, world_size: int, batch_size: int, drop_last: bool, max_batches: int | None
) -> int:
    """This rank's batches in a pass over positions ``[start, end)``, ``max_batches`` counted
    from the epoch's start in global batches of ``batch_size * world_size`` samples."""
    per_rank = (end - start) // world_size
    count = per_rank // batch_size if drop_last else -(-per_rank // batch_size)
    if max_batches:
        step = batch_size * world_size
        count = min(count, max(0, -(-(max_batches * step - start) // step)))
    return count


class ShardedLoader:
    """A ``DataLoader`` over this rank's shard whose sampler epoch advances on every ``iter()``.

    The n-th pass over the loader (counting from 0) uses epoch ``start_epoch + n``, so each epoch
    has a new order and the ranks stay in step without a ``set_epoch`` call. Use
    :meth:`set_epoch` to jump, and :meth:`state_dict`/:meth:`load_state_dict` to resume exactly
    in the middle of an epoch (every remaining sample of that epoch seen once, none twice), on
    the same or another number of ranks.

    Randomness: the order comes from ``seed + epoch`` (the same on every rank); augmentation
    draws come from ``(seed, rank, epoch)`` for worker processes and ``(seed, rank, epoch,
    batch)`` for main-process loading (see :mod:`ddpkit.data.seeding`), so they differ
    across ranks and workers and repeat on a rerun or resume.

    Attributes:
        loader: the wrapped ``torch.utils.data.DataLoader``.
        sampler: its :class:`~ddpkit.data.shards.ResumableDistributedSampler` (``None`` for a
            stream).
        stream: the :class:`~ddpkit.data.streams.ShardedStream` (``None`` for a
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
        sampler: ResumableDistributedSampler | None,
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
        self._resume_at: dict[str, int] | None = None  # a loaded position for the next pass
        self._pass: _Pass | None = None  # the open pass

    def reshard(self, rank: int, world_size: int) -> None:
        """Shard the next pass for ``rank`` of ``world_size`` (live fault tolerance: the members
        changed). The global position is unchanged: load the committed one
        (:meth:`load_state_dict`) and iterate again to go on from there. Not a collective.

        Raises:
            ConfigError: a stream (``IterableDataset``), whose position is per rank x worker
                slot and cannot move to another number of ranks.
        """
        if self.sampler is None:
            raise ConfigError(
                "live fault tolerance with a stream (IterableDataset): its position is per "
                "rank x worker slot and cannot be dealt to another number of ranks. Use a "
                "map-style dataset (__len__ and __getitem__)."
            )
        self.sampler.reshard(num_replicas=world_size, rank=rank)
        self.rank = rank
        self.rank_batch_sizes = [self.loader.batch_size or 1] * world_size
        self.rank_num_batches = [self.full_pass_batches() or 0] * world_size

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass use ``epoch`` (from its start)."""
        self.epoch, self._resume_at = epoch, None

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
            length,
            self.stream.world_size,
            self.loader.num_workers,
            batch_size,
            self.loader.drop_last,
        )

    def __len__(self) -> int:
        """Batches in one full pass (the whole shard, capped by ``max_batches``).

        Raises:
            TypeError: a stream without ``__len__`` and no ``max_batches``.
        """
        full = self.full_pass_batches()
        if full is None:
            if self.max_batches:
                return self.max_batches
            assert self.stream is not None  # only a stream has no length
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
        """Batches of the current pass on this rank so far, counting from the epoch's start
        (after a resume: the batches this world size would have taken to get there)."""
        return self._pass.first + self._pass.done if self._pass is not None else 0

    def _pass_length(self) -> int | None:
        try:
            return len(self)
        except TypeError:
            return None

    @property
    def _world_size(self) -> int:
        if self.sampler is not None:
            return self.sampler.num_replicas
        assert self.stream is not None  # a loader has a sampler or a stream
        return self.stream.world_size

    def _plan(self, epoch: int) -> _Pass:
        """The geometry of the next pass (``epoch``), from the loaded position if any."""
        position = self._resume_at
        if self.sampler is None:  # a stream: a batch count per rank x worker slot
            skip = position["batches_done"] if position else 0
            per_pass = self._pass_length()
            count = None if per_pass is None else max(per_pass - skip, 0)
            return _Pass(epoch, first=skip, num_batches=count)
        batch_size, world_size = self.loader.batch_size or 1, self._world_size
        drop_last = self.loader.drop_last
        start, end = 0, self.sampler.total_size
        if position is not None and position["samples_done"]:
            start = position["samples_done"]
            end = resumed_end(start, position["epoch_samples"], world_size, drop_last)
        count = pass_batches(start, end, world_size, batch_size, drop_last, self.max_batches)
        return _Pass(
            epoch, start // (batch_size * world_size), count, start, end, world_size=world_size
        )

    def next_pass_size(self) -> tuple[int | None, int | None]:
        """``(batches, samples)`` of the next pass: this rank's batches and every rank's samples
        (after a resume, what is left of the epoch); ``None`` where a stream does not know.
        Not a collective."""
        plan = self._plan(self.epoch)
        if plan.num_batches is None or self.sampler is None:
            return plan.num_batches, None
        step = (self.loader.batch_size or 1) * self._world_size
        return plan.num_batches, min(plan.end, plan.start + plan.num_batches * step) - plan.start

    def state_dict(self) -> dict[str, Any]:
        """Where the next batch would come from, the same on every rank.

        A map-style dataset: ``{"epoch", "samples_done", "epoch_samples"}``, a global cursor:
        the samples of the epoch (over all ranks) done so far and where the epoch's positions
        end (see :class:`~ddpkit.data.shards.ResumableDistributedSampler`), plus
        ``world_size``, ``batch_size`` and ``dataset_len`` for the record and the checks. The
        cursor means the same on any number of ranks. A stream: ``{"epoch", "batches_done"}``
        per rank, with ``world_size`` and ``num_workers``. A pass whose last batch was handed
        out counts as finished (the next epoch, nothing done). Worker seeds are derived again
        from the epoch, so no generator is stored.
        """
        batch_size = self.loader.batch_size or 1
        meta: dict[str, Any] = {"world_size": self._world_size, "batch_size": batch_size}
        if self.sampler is not None:
            meta["dataset_len"] = len(self.loader.dataset)  # type: ignore[arg-type]
            meta["sampler"] = self._sampler_signature()
        else:
            meta["num_workers"] = self.loader.num_workers
        current = self._pass
        if current is None:
            return {**(self._resume_at or self._fresh(self.epoch)), **meta}
        if current.num_batches is not None and current.done >= current.num_batches:
            return {**self._fresh(current.epoch + 1), **meta}
        if self.sampler is None:
            return {"epoch": current.epoch, "batches_done": current.first + current.done, **meta}
        done = min(current.start + current.done * batch_size * current.world_size, current.end)
        return {"epoch": current.epoch, "samples_done": done, "epoch_samples": current.end, **meta}

    def _fresh(self, epoch: int) -> dict[str, int]:
        if self.sampler is None:
            return {"epoch": epoch, "batches_done": 0}
        return {"epoch": epoch, "samples_done": 0, "epoch_samples": 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next pass resume epoch ``state["epoch"]`` where :meth:`state_dict` left it.

        A map-style position resumes on any number of ranks and any batch size: the rest of the
        epoch is re-sharded among this loader's ranks (see :meth:`state_dict`). A state of
        ddpkit before the global cursor (``{"epoch", "batches_done"}``) is read as batches of
        this world size and batch size; a ``"generator"`` entry (before 0.2) is ignored.

        Raises:
            ConfigError: the state is of a dataset of another length; a stream's position
                inside an epoch, written by another world size or number of workers; an old
                state (no global cursor) written by another world size.
        """
        epoch = int(state["epoch"])
        if self.sampler is None:
            position = {"epoch": epoch, "batches_done": self._stream_position(state)}
            moved = position["batches_done"]
        else:
            done, end = self._map_position(state)
            position = {"epoch": epoch, "samples_done": done, "epoch_samples": end}
            moved = done
        self.epoch = epoch
        self._resume_at = position if moved else None

    def _map_position(self, state: dict[str, Any]) -> tuple[int, int]:
        """``(samples_done, epoch_samples)`` of a map-style state, old formats converted."""
        length = len(self.loader.dataset)  # type: ignore[arg-type]
        saved_len = state.get("dataset_len", length)
        if saved_len != length:
            raise ConfigError(
                f"loader state of another dataset: len(dataset)={length}, the state was written "
                f"for a dataset of {saved_len} samples. Resume with the same data set, or start "
                "fresh."
            )
        mine, saved = self._sampler_signature(), state.get("sampler")
        if saved != mine and state.get("samples_done", state.get("batches_done")):
            raise ConfigError(
                f"loader state of another sampler: this loader draws "
                f"{mine or 'a shuffle of the dataset'}; the state was written by one drawing "
                f"{saved or 'a shuffle of the dataset'}, so its position means other samples. "
                "Resume with the same sampler (weights, num_samples, replacement), or start the "
                "epoch fresh."
            )
        if "samples_done" in state:
            return int(state["samples_done"]), int(state["epoch_samples"])
        batches = int(state["batches_done"])  # before the global cursor: batches on this size
        saved_size = state.get("world_size", self._world_size)
        if batches and saved_size != self._world_size:
            raise ConfigError(
                f"cannot resume an old loader state on another world size: world_size="
                f"{self._world_size}, the state (batches_done={batches}, written before ddpkit "
                f"kept a global cursor) is of world_size {saved_size}. Resume it on "
                f"{saved_size} ranks."
            )
        assert self.sampler is not None  # load_state_dict reads a map-style position only here
        return batches * (self.loader.batch_size or 1) * self._world_size, self.sampler.total_size

    def _sampler_signature(self) -> str | None:
        """A weighted sampler's ``signature()`` (weights hashed, num_samples, replacement);
        ``None`` for the plain shuffle."""
        signature = getattr(self.sampler, "signature", None)
        return signature() if callable(signature) else None

    def _stream_position(self, state: dict[str, Any]) -> int:
        batches = int(state["batches_done"])
        here = (self._world_size, self.loader.num_workers)
        saved = (state.get("world_size", here[0]), state.get("num_workers", here[1]))
        if batches and saved != here:
            raise ConfigError(
                f"cannot resume a stream inside an epoch on another layout: world_size="
                f"{here[0]}, num_workers={here[1]}; the checkpoint was written by world_size "
                f"{saved[0]}, num_workers {saved[1]} ({batches} batches done per rank x worker "
                f"slot, a position only that layout can continue). Resume with {saved[0]} ranks "
                f"and {saved[1]} workers, resume from a checkpoint at an epoch boundary, or use "
                "a map-style dataset (__len__ and __getitem__), whose position is global and "
                "resumes on any number of ranks."
            )
        return batches

    def __iter__(self) -> Iterator[Any]:
        epoch = self.epoch
        plan = self._plan(epoch)
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)
            fresh = plan.start == 0 and plan.end == self.sampler.total_size
            self.sampler.span = None if fresh else (plan.start, plan.end)
        else:
            assert self.stream is not None  # a loader has a sampler or a stream
            self.stream.begin_pass(epoch, plan.first)
        self.loader.generator.manual_seed(worker_base_seed(self.seed, self.rank, epoch))
        self.epoch, self._resume_at, self._pass = epoch + 1, None, plan
        self._warn_batch_sizes_once()
        try:
            if plan.num_batches == 0:
                return
            batches = iter(self.loader)
            while plan.num_batches is None or plan.done < plan.num_batches:
                batch = self._next_batch(batches, epoch, plan.first + plan.done)
                if batch is _END:
                    break
                plan.done += 1
                yield batch
            if plan.first + plan.done == 0:
                raise self._empty_pass_error()
        finally:  # exhausted, capped, or the caller broke out: the pass is over either way
            self._pass = None

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
        if uneven and counts is not None:  # uneven implies counts
            parts.append(
                "the batches per pass differ ("
                + ", ".join(f"rank {r} {c}" for r, c in enumerate(counts))
                + "), so under DDP the rank with more waits in an all-reduce the others never "
                "join (ddpkit.join_uneven_inputs lets them finish)"
            )
        if parts:
            listing = ", ".join(f"rank {r} {b}" for r, b in enumerate(sizes))
            log.warning(
                "ranks use different batch sizes (%s): %s. Pass the same batch_size on every rank.",
                listing,
                "; and ".join(parts),
            )
