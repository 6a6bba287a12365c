"""Asynchronous sharded saves (``CheckpointManager(..., async_save=True)``; off by default).

A save then blocks the training loop only while torch's ``dcp.async_save`` copies each rank's
shards to CPU memory (its default stager: a deep copy, so training may change the parameters
right after) and rank 0 writes ``state.pt``; the shard files are written by a background thread.
The commit (each rank's file hashes, the manifest, the rename to ``step-XXXXXXXX``) happens at
the next :meth:`CheckpointManager.save`, :meth:`~CheckpointManager.resume` or
:meth:`~CheckpointManager.wait`, in the training thread, with every rank, so a save still
appears complete or not at all. Until then the checkpoint is a ``.tmp-`` folder, and a job that
dies first resumes from the previous one.

The background thread runs DCP's own collectives (plans, results), which must never interleave
with the training group's: they go over a second process group, gloo, created once at the
first asynchronous save (``dist.new_group``, a collective every rank reaches there), with the
training group's timeout (torchtitan does the same). One save is in flight at a time.

Call :meth:`CheckpointManager.wait` on every rank before the job ends (``ddpkit train`` does):
a save not waited for is never committed.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpkit.checkpoint.io import (
    checkpoint_dir_name,
    commit_checkpoint,
    temporary_dir,
    write_state_file,
)
from ddpkit.checkpoint.sharded import (
    error_text,
    gather_hashes,
    prepare_folder,
    raise_if_any,
    removed_on_failure,
    shard_writer,
    sharded_state,
)
from ddpkit.runtime.collectives import all_gather_object
from ddpkit.runtime.process_group import Runtime


@dataclass
class _InFlight:
    step: int
    tmp: Path
    directory: Path
    future: Any
    meta: dict[str, Any]
    prune: Callable[[], None]


class AsyncShardedSaves:
    """At most one asynchronous sharded save in flight; :meth:`finish` commits it.

    Args:
        runtime: the job's :class:`~ddpkit.Runtime` (world size 2+: sharded state needs it).
        on_commit: called with each folder once it is committed (complete on disk).
    """

    def __init__(self, runtime: Runtime, on_commit: Callable[[Path], None] | None = None) -> None:
        self.runtime = runtime
        self.on_commit = on_commit
        self._group: Any = None
        self._in_flight: _InFlight | None = None

    @property
    def in_flight(self) -> int | None:
        """The step of the save not yet committed, else ``None``."""
        return self._in_flight.step if self._in_flight else None

    def _checkpoint_group(self) -> Any:
        import torch.distributed as dist

        if self._group is None:  # every rank reaches its first asynchronous save together
            timeout = datetime.timedelta(seconds=self.runtime.train_timeout_s)
            with self.runtime.watch("async checkpoint: new_group(gloo)"):
                self._group = dist.new_group(backend="gloo", timeout=timeout)
        return self._group

    def start(
        self,
        directory: Path,
        state: Mapping[str, Any],
        entries: dict[str, str],
        step: int,
        *,
        replicated: Callable[[], dict[str, Any]],
        meta: dict[str, Any],
        prune: Callable[[], None],
    ) -> Path:
        """Start saving ``step`` (after committing the one in flight); returns the folder it
        will have once committed. Collective: call on every rank.

        Raises:
            DistributedError: the previous save, the folder or ``state.pt`` failed on a rank.
        """
        import torch.distributed.checkpoint as dcp

        self.finish()
        runtime = self.runtime
        tmp = temporary_dir(directory, step, all_gather_object(os.getpid(), runtime)[0])
        with removed_on_failure(runtime, tmp):
            prepare_folder(runtime, tmp, step)
            error = None
            if runtime.is_rank_zero:
                try:
                    saved = {**replicated(), "sharded": dict(entries)}
                    saved.update(step=step, world_size=runtime.world_size, extra=meta.get("extra"))
                    write_state_file(tmp, saved)
                except Exception as exc:  # noqa: BLE001 - every rank must learn of it
                    error = error_text(exc)
            raise_if_any(all_gather_object({"error": error}, runtime), step, "rank 0's state.pt")
            writer, planner = shard_writer(tmp)
            future = dcp.async_save(
                sharded_state(state, entries),
                storage_writer=writer,
                planner=planner,
                process_group=self._checkpoint_group(),
            )
        meta = {**meta, "sharded": dict(entries)}
        self._in_flight = _InFlight(step, tmp, directory, future, meta, prune)
        return directory / checkpoint_dir_name(step)

    def finish(self) -> Path | None:
        """Wait for the save in flight, then commit it; returns its folder (``None``: none in
        flight). Collective: call on every rank (two all-gathers).

        Raises:
            DistributedError: a rank failed to write its shard (every rank raises, naming it;
                nothing is committed).
        """
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return None
        runtime, error = self.runtime, None
        try:
            with runtime.watch("async checkpoint: wait for the shards"):
                flight.future.result()
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it
            error = error_text(exc)
        with removed_on_failure(runtime, flight.tmp):
            files = gather_hashes(runtime, flight.tmp, flight.step, error)
            error, folder = None, flight.directory / checkpoint_dir_name(flight.step)
            if runtime.is_rank_zero:
                try:
                    commit_checkpoint(
                        flight.tmp, flight.directory, flight.step, None, flight.meta, files
                    )
                    flight.prune()
                except Exception as exc:  # noqa: BLE001 - every rank must learn of it
                    error = error_text(exc)
            raise_if_any(all_gather_object({"error": error}, runtime), flight.step, "the commit")
        if self.on_commit is not None:
            self.on_commit(folder)
        return folder
