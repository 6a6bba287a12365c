"""Checkpoint manager: collective save by a single writer, exact resume, fallback on corruption.

What a checkpoint holds: the ``state_dict()`` of every object the manager was given (models
unwrapped, with no ``module.``/``_orig_mod.`` prefix; a ``ZeroRedundancyOptimizer``
consolidated first; the LR scheduler, grad scaler, an EMA, the sharded loader's position inside
the epoch, ...), the step, every rank's RNG states (torch, CUDA, numpy, python) and the world
size.
Resuming puts all of them back, so a run stopped at step k and resumed ends bitwise equal to an
uninterrupted run. Replicated state is written by rank 0 after it was compared across ranks
(:mod:`ddpkit.checkpoint.consistency`): a copy that differs on some rank is reported, never
silently dropped.

Example::

    state = {"model": model, "optimizer": opt, "scheduler": sched, "loader": train_loader}
    ckpt = CheckpointManager("runs/ckpt", rt, state=state, keep_last=3, every_steps=100)
    step = ckpt.resume()
    while step < total_steps:
        for x, y in train_loader:
            ...; step += 1
            ckpt.maybe_save(step)
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.checkpoint.consistency import (
    BUFFERS_OF,
    describe,
    differences,
    raise_if_parameters_differ,
    replicated_digests,
    section_name,
)
from ddpkit.checkpoint.io import (
    MANIFEST,
    checkpoint_dir_name,
    list_checkpoints,
    load_checkpoint,
    read_manifest,
    write_checkpoint,
)
from ddpkit.checkpoint.objects import (
    LOCAL_SGD_NOTE,
    check_extra,
    check_saved_state,
    check_state,
    is_local_sgd_optimizer,
    is_zero_optimizer,
)
from ddpkit.checkpoint.state import load_model_state, rng_state, set_rng_state
from ddpkit.distributed.collectives import all_gather_object, all_reduce_sum, barrier
from ddpkit.distributed.process_group import Runtime
from ddpkit.distributed.stop import TrainingStopped
from ddpkit.errors import ConfigError, DataError, DistributedError
from ddpkit.guards.replicas import buffer_fix
from ddpkit.log import get_logger
from ddpkit.parallel.wrap import unwrap_model

log = get_logger("checkpoint")


def check_compatible(folder: Path, manifest: dict, world_size: int, extra: dict | None) -> None:
    """Refuse a checkpoint written by another world size or with other run settings.

    ``extra`` holds settings that must be equal (for ``ddpkit train``: batch size, epochs, lr,
    ...): resuming with a different batch size would skip the wrong samples, and a different
    number of epochs would not match the saved LR schedule.

    Raises:
        ConfigError: names the checkpoint, each differing setting, and both values.
    """
    problems = []
    if manifest.get("world_size") != world_size:
        problems.append(f"world_size {manifest.get('world_size')} (this job: {world_size})")
    saved = manifest.get("extra") or {}
    for key, value in (extra or {}).items():
        if key in saved and saved[key] != value:
            problems.append(f"{key} {saved[key]!r} (this job: {value!r})")
    if problems:
        raise ConfigError(
            f"checkpoint {folder} does not match this job: it was written with "
            f"{'; '.join(problems)}. Resume with the same settings and number of processes, "
            "or start fresh without --resume."
        )


def newest_manifest(directory: Path) -> tuple[Path, dict] | None:
    """The newest checkpoint folder that has a manifest, without reading its state."""
    for folder in list_checkpoints(directory):
        try:
            return folder, read_manifest(folder)
        except DataError:
            continue
    return None


def _module_or_state(obj: Any) -> Any:
    """What is saved of one entry: an ``nn.Module`` without its wrappers' key prefixes."""
    return unwrap_model(obj).state_dict() if isinstance(obj, torch.nn.Module) else obj.state_dict()


def _notes(state: dict[str, Any]) -> dict[str, str]:
    """What explains a difference in each section, for :func:`describe`."""
    notes = {}
    for name, obj in state.items():
        if isinstance(obj, torch.nn.Module):
            notes[f"{name} {BUFFERS_OF}"] = buffer_fix(obj)
        elif is_local_sgd_optimizer(obj):
            notes[section_name(name)] = LOCAL_SGD_NOTE
    return notes


def _saved_state(folder: Path, state: dict[str, Any]) -> dict[str, Any]:
    """The ``{name: state dict}`` of a checkpoint (format 2).

    Raises:
        DataError: a checkpoint of format 1 (separate model/optimizer/... entries).
    """
    if "state" not in state:
        raise DataError(
            f"checkpoint {folder} has format 1 (separate model/optimizer entries, written "
            "before CheckpointManager took its state once); this version resumes format 2. "
            "Start fresh, or resume it with the ddpkit version that wrote it."
        )
    return state["state"]


class CheckpointManager:
    """Save and resume the training state it is given, under ``directory``.

    Args:
        directory: where ``step-XXXXXXXX/`` folders go (on a filesystem every rank can read).
        runtime: the job's :class:`~ddpkit.Runtime`.
        state: ``{name: object}``, everything to save and restore: any object with
            ``state_dict()``/``load_state_dict()`` (the model, optimizer, LR scheduler,
            ``GradScaler``, :class:`~ddpkit.ShardedLoader`, an EMA, your own). ``None`` values
            are left out (``"scaler": precision.scaler`` without fp16). An ``nn.Module`` is
            saved unwrapped (no ``module.``/``_orig_mod.`` prefix) and its parameters must
            agree across ranks; a ``ZeroRedundancyOptimizer`` is consolidated on rank 0 first.
            The names key the checkpoint: resume with the same names.
        keep_last: complete checkpoints to keep (older ones are deleted by rank 0), >= 1.
        every_steps: :meth:`maybe_save` saves when ``step % every_steps == 0`` (0 = never);
            it also saves, and stops, at a step the ranks agreed to stop at after a signal.
        every_epochs: :meth:`maybe_save_epoch` saves after every this many epochs (0 = never).
        extra: JSON settings written to the manifest (batch size, lr, ...); :meth:`resume`
            refuses a checkpoint whose settings differ (see :func:`check_compatible`).

    Raises:
        ConfigError: ``keep_last < 1``, or a negative ``every_steps``/``every_epochs``.
        TypeError: ``state`` is not a dict of objects with ``state_dict``/``load_state_dict``,
            or ``extra`` holds a non-JSON value (on every rank, before anything happens).

    Example:
        >>> ckpt = CheckpointManager("ckpt", rt, state={"model": model, "optimizer": opt})
        >>> step = ckpt.resume()  # 0 when there is no checkpoint yet   # doctest: +SKIP
        >>> ckpt.save(step)                                              # doctest: +SKIP
    """

    def __init__(
        self,
        directory: str | Path,
        runtime: Runtime,
        *,
        state: Mapping[str, Any] | None = None,
        keep_last: int = 3,
        every_steps: int = 0,
        every_epochs: int = 0,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        if keep_last < 1 or every_steps < 0 or every_epochs < 0:
            raise ConfigError(
                f"invalid checkpoint settings: keep_last={keep_last} (must be >= 1), "
                f"every_steps={every_steps}, every_epochs={every_epochs} (must be >= 0)."
            )
        check_extra(extra)
        self.state = check_state(state)
        self.extra = dict(extra or {})
        self.directory = Path(directory)
        self.runtime = runtime
        self.keep_last = keep_last
        self.every_steps = every_steps
        self.save_s = 0.0  # seconds spent in save() so far (the goodput's checkpoint time)
        self._newest: tuple[int, Path] | None = None  # the newest complete checkpoint known
        self.every_epochs = every_epochs

    def _managed(self, action: str) -> dict[str, Any]:
        if not self.state:
            raise ConfigError(
                f"CheckpointManager.{action}(): the manager holds no state. Pass what to "
                "checkpoint once, when you build it: CheckpointManager(directory, runtime, "
                "state={'model': model, 'optimizer': optimizer, ...})."
            )
        return self.state

    def save(self, step: int) -> Path:
        """Write checkpoint ``step`` of the managed state; returns its folder once complete.

        Collective: call on every rank at the same step. A ``ZeroRedundancyOptimizer`` is
        consolidated on rank 0 first. One all-gather brings every rank's RNG state and the
        checksums of its replicated state to every rank (see
        :mod:`ddpkit.checkpoint.consistency`); rank 0 alone writes (atomically: a failure at
        any point leaves no folder behind), then one all-reduce tells every rank whether it
        succeeded, so all return once the checkpoint is complete or all raise. At world size 1
        it writes without any collective.

        Args:
            step: the optimizer step; names the folder ``step-XXXXXXXX``.

        Raises:
            ConfigError: the manager was built without ``state``.
            ReplicaDivergenceError: a module's parameters differ across ranks (nothing is
                written). Other replicated state that differs is saved from rank 0 with a
                warning naming it and the ranks, and listed in the manifest.
            DistributedError: rank 0 failed to write (raised on the other ranks; rank 0
                raises its own error).

        Example:
            >>> ckpt.save(step)  # doctest: +SKIP
        """
        managed, start = self._managed("save"), time.perf_counter()
        for obj in managed.values():
            if is_zero_optimizer(obj) and self.runtime.process_group is not None:
                with self.runtime.watch("ZeroRedundancyOptimizer.consolidate_state_dict"):
                    obj.consolidate_state_dict(to=0)
        digests = replicated_digests(managed) if self.runtime.process_group is not None else {}
        gathered = all_gather_object({"rng": rng_state(), "digests": digests}, self.runtime)
        found = differences([g["digests"] for g in gathered])
        raise_if_parameters_differ(found, step)
        folder, error = self.directory / checkpoint_dir_name(step), None
        if self.runtime.is_rank_zero:
            try:
                if found:
                    log.warning(describe(found, folder.name, _notes(managed)))
                state = {
                    "state": {name: _module_or_state(obj) for name, obj in managed.items()},
                    "rng_per_rank": [g["rng"] for g in gathered],
                }
                folder = self._write(step, state, found)
            except Exception as exc:  # noqa: BLE001 - every rank must learn of it
                error = exc
        self._agree_written(step, error)
        self._newest = (step, folder)
        self.save_s += time.perf_counter() - start
        return folder

    def _write(self, step: int, state: dict, found: dict) -> Path:
        """Rank 0: write the folder atomically, then prune older ones."""
        state.update(step=step, world_size=self.runtime.world_size, extra=self.extra)
        meta = {"world_size": self.runtime.world_size, "extra": self.extra}
        if found:
            meta["differs_across_ranks"] = {s: list(ranks) for s, ranks in found.items()}
        folder = write_checkpoint(self.directory, step, state, meta)
        self._prune()
        return folder

    def _agree_written(self, step: int, error: Exception | None) -> None:
        """Every rank returns once rank 0 wrote the checkpoint, or every rank raises.

        Collective: one all-reduce (two on failure: rank 0's message is broadcast).
        """
        if self.runtime.process_group is None:
            if error is not None:
                raise error
            return
        if not int(all_reduce_sum([error is not None], self.runtime)[0]):
            return
        message = [f"{type(error).__name__}: {error}" if error is not None else None]
        with self.runtime.watch("checkpoint save: broadcast rank 0's error"):
            dist.broadcast_object_list(message, group=self.runtime.process_group, group_src=0)
        if error is not None:
            raise error
        raise DistributedError(
            f"checkpoint step {step} not written: rank 0 failed to write it ({message[0]}). "
            "Nothing was left half-written; see rank 0's traceback for the cause."
        )

    def maybe_save(self, step: int) -> Path | None:
        """:meth:`save` when ``every_steps`` divides ``step``; after a stop signal, at the step
        the ranks agree on (:meth:`ddpkit.Runtime.stop_requested`, asked here): save, then
        raise :class:`~ddpkit.TrainingStopped`.

        Collective like :meth:`save`: call on every rank after every step (a call at step 0,
        or at the step just resumed, saves nothing).

        Raises:
            TrainingStopped: every rank agreed to stop; ``step`` was saved first, unless nothing
                was trained since the newest checkpoint (or ``step`` is 0). Uncaught, it ends
                the process with status 128 + the signal number.
        """
        if self.runtime.stop_requested():
            raise self._stopped(step)
        if self.every_steps and step % self.every_steps == 0 and self._is_new(step):
            return self.save(step)
        return None

    def _is_new(self, step: int) -> bool:
        """Whether ``step`` has been trained since the newest checkpoint this manager knows."""
        return step > 0 and (self._newest is None or self._newest[0] != step)

    def _stopped(self, step: int) -> TrainingStopped:
        """Save ``step`` for the agreed stop (unless nothing was trained since the newest
        checkpoint); the exception to raise. Collective."""
        fresh = self._is_new(step)
        folder = self.save(step) if fresh else (self._newest[1] if self._newest else None)
        assert self.runtime.stop is not None and self.runtime.stop.agreed is not None
        return TrainingStopped(self.runtime.stop.agreed, step=step, checkpoint=folder, saved=fresh)

    def maybe_save_epoch(self, epoch: int, *, step: int) -> Path | None:
        """After epoch ``epoch`` (1-based) ends: :meth:`save` of ``step`` when
        ``every_epochs`` divides ``epoch``.

        Collective like :meth:`save`; call it once the loader's pass is over, so the checkpoint
        resumes at the start of the next epoch.
        """
        if self.every_epochs and epoch % self.every_epochs == 0:
            return self.save(step)
        return None

    def _prune(self) -> None:
        """Keep the newest ``keep_last`` complete checkpoints; drop older debris.

        Debris: ``.tmp-*`` folders of writers that died mid-save, and folders without a
        manifest older than the newest complete checkpoint.
        """
        folders = list_checkpoints(self.directory)
        complete = [p for p in folders if (p / MANIFEST).is_file()]
        newest = int(complete[0].name[5:]) if complete else -1
        stale = [p for p in folders if p not in complete and int(p.name[5:]) < newest]
        for old in complete[self.keep_last :] + stale:
            shutil.rmtree(old, ignore_errors=True)
        for tmp in self.directory.glob(".tmp-*"):  # dead writers' saves and probes
            if not tmp.name.endswith(f"-{os.getpid()}"):
                shutil.rmtree(tmp, ignore_errors=True)

    def load_latest(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest checkpoint that verifies, as ``(folder, state)``; ``None`` if there is none.

        Newer checkpoints that fail their checksum (or lack a manifest) are skipped with a
        warning naming them; the previous complete one is used. Not a collective.
        """
        for folder in list_checkpoints(self.directory):
            try:
                return folder, load_checkpoint(folder)
            except DataError as exc:
                log.warning(
                    "skipping checkpoint %s: %s Falling back to the previous one.", folder.name, exc
                )
        return None

    def resume(self, path: str | Path | None = None) -> int:
        """Restore the newest complete checkpoint (or ``path``) into the managed state; returns
        its step, 0 if there is none (the state is left as it is).

        Storages are mapped to CPU, then each tensor goes to the device of the object it is
        loaded into (never every rank onto cuda:0). Checkpoints newer than the one resumed (an
        abandoned future, e.g. when ``path`` names an older one) are deleted, so later saves and
        ``resume`` calls never mix two histories. Only resume checkpoints you trust: the state
        is unpickled. A ``ZeroRedundancyOptimizer`` takes its own shard of the consolidated
        state.

        Collective: call on every rank; the ranks check they resumed the same checkpoint. At
        world size 1 no collective runs.

        Args:
            path: a ``step-XXXXXXXX`` folder to resume instead of the newest complete one.

        Raises:
            ConfigError: the manager was built without ``state``; the checkpoint was written by
                another world size or other settings (see :func:`check_compatible`).
            DataError: ``path`` is corrupt or incomplete; a managed object has no state in the
                checkpoint.
            DistributedError: the ranks found different newest checkpoints.

        Example:
            >>> step = ckpt.resume()  # doctest: +SKIP
        """
        managed = self._managed("resume")
        if path is not None:
            found: tuple[Path, dict[str, Any]] | None = (Path(path), load_checkpoint(Path(path)))
        else:
            found = self.load_latest()
        names = all_gather_object(found[0].name if found else None, self.runtime)
        if len(set(names)) > 1:
            listing = ", ".join(f"rank {r}: {n}" for r, n in enumerate(names))
            raise DistributedError(
                f"ranks found different checkpoints to resume ({listing}). Put {self.directory} "
                "on a filesystem every rank sees the same way."
            )
        if found is None:
            return 0
        folder, state = found
        check_compatible(folder, read_manifest(folder), self.runtime.world_size, self.extra)
        saved = _saved_state(folder, state)
        check_saved_state(folder, saved, managed)
        modules = [n for n, obj in managed.items() if isinstance(obj, torch.nn.Module)]
        for name in modules + [n for n in managed if n not in modules]:  # modules first
            if name in modules:
                load_model_state(managed[name], saved[name])
            else:
                managed[name].load_state_dict(saved[name])
        set_rng_state(state["rng_per_rank"][self.runtime.rank])
        barrier(self.runtime)  # every rank has read it before newer ones are removed
        if self.runtime.is_rank_zero:
            for newer in list_checkpoints(self.directory):
                if int(newer.name[5:]) > int(state["step"]):
                    shutil.rmtree(newer, ignore_errors=True)
        barrier(self.runtime)
        self._newest = (int(state["step"]), folder)
        log.info("resumed from %s (step %d)", folder, state["step"])
        return int(state["step"])
