"""Checkpoint manager: collective save by a single writer, exact resume, fallback on corruption.

What a checkpoint holds: the ``state_dict()`` of every object the manager was given (models
unwrapped, with no ``module.``/``_orig_mod.`` prefix; an ``fsdp`` model, its optimizer and a
``ZeroRedundancyOptimizer`` as every rank's shards, see :mod:`ddpkit.checkpoint.sharded`; the
LR scheduler, grad scaler, an EMA, the sharded loader's position inside
the epoch, ...), the step, every rank's RNG states (torch, CUDA, numpy, python) and the world
size.
Resuming puts all of them back, so a run stopped at step k and resumed ends bitwise equal to an
uninterrupted run; on another world size the loader's global position re-shards the rest of the
epoch (see :meth:`CheckpointManager.resume`). Replicated state is written by rank 0 after it was
compared across ranks (:mod:`ddpkit.checkpoint.consistency`): a copy that differs on some rank
is reported, never silently dropped. An LR scheduler or a used ``GradScaler`` left out of the
state is named in one warning (:mod:`ddpkit.checkpoint.forgotten`).

Example:
    >>> state = {"model": model, "optimizer": opt, "scheduler": schedule, "loader": loader}
    >>> ckpt = CheckpointManager("runs/ckpt", rt, state=state, keep_last=3, every_steps=2)
    >>> step = ckpt.resume()  # the newest checkpoint's step, all of state back; 0: none yet
    >>> train_step = TrainStep(model, opt, runtime=rt, start_step=step)
    >>> for result in train_epoch(train_step, loader):  # 4 steps: saved after 2 and 4
    ...     path = ckpt.maybe_save(result.step)
    >>> ckpt.resume()  # as a restarted job would
    4
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

from ddpkit.checkpoint.async_save import AsyncShardedSaves
from ddpkit.checkpoint.changes import check_module_fits, optimizer_changes
from ddpkit.checkpoint.config import KEEP_LAST
from ddpkit.checkpoint.consistency import (
    BUFFERS_OF,
    describe,
    differences,
    raise_if_parameters_differ,
    replicated_digests,
    section_name,
)
from ddpkit.checkpoint.forgotten import ForgottenStateCheck
from ddpkit.checkpoint.io import (
    MANIFEST,
    checkpoint_dir_name,
    list_checkpoints,
    load_checkpoint,
    read_manifest,
    write_checkpoint,
)
from ddpkit.checkpoint.lock import lock_directory
from ddpkit.checkpoint.objects import (
    LOCAL_SGD_NOTE,
    check_extra,
    check_saved_state,
    check_state,
    is_local_sgd_optimizer,
)
from ddpkit.checkpoint.rng import restore_rng_state
from ddpkit.checkpoint.sharded import check_layouts, load_sharded, save_sharded, sharded_entries
from ddpkit.checkpoint.state import load_model_state, rng_state
from ddpkit.data.loader import ShardedLoader
from ddpkit.diagnostics.failures import note_checkpoint, record_failure
from ddpkit.errors import ConfigError, DataError, DistributedError
from ddpkit.guards.replicas import buffer_fix
from ddpkit.log import get_logger
from ddpkit.parallel.wrap import unwrap_model
from ddpkit.runtime.collectives import all_gather_object, all_reduce_sum, barrier
from ddpkit.runtime.process_group import Runtime
from ddpkit.runtime.stop import TrainingStopped

log = get_logger("checkpoint")
SET_ASIDE = "set-aside"  # checkpoints a resume moved out of the way: never deleted by ddpkit


def set_aside(folder: Path, into: Path) -> Path:
    """Move ``folder`` into the folder ``into`` (created), under a new name if that one is
    taken; returns where it went. A rename: the same file system, nothing copied."""
    into.mkdir(exist_ok=True)
    target, n = into / folder.name, 1
    while target.exists():
        target, n = into / f"{folder.name}.{n}", n + 1
    folder.rename(target)
    return target


def check_compatible(folder: Path, manifest: dict, extra: dict | None) -> None:
    """Refuse a checkpoint written with other run settings.

    ``extra`` holds settings that must be equal (for ``ddpkit train``: epochs, lr, the global
    batch, ...): a different number of epochs would not match the saved LR schedule. The
    world size may differ (the data position is global; see :meth:`CheckpointManager.resume`).
    A setting the checkpoint does not record (written before it existed) is not compared.

    Raises:
        ConfigError: names the checkpoint, each differing setting, and both values.
    """
    problems = []
    saved = manifest.get("extra") or {}
    for key, value in (extra or {}).items():
        if key in saved and saved[key] != value:
            problems.append(f"{key} {saved[key]!r} (this job: {value!r})")
    if problems:
        raise ConfigError(
            f"checkpoint {folder} does not match this job: it was written with "
            f"{'; '.join(problems)}. Resume with the same settings (another number of "
            "processes is fine), or start fresh without --resume."
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
            agree across ranks (an ``fsdp`` model: its buffers); sharded state (``fsdp``,
            ``ZeroRedundancyOptimizer``) is saved by every rank, its own shard.
            The names key the checkpoint: resume with the same names. An LR scheduler or a used
            ``GradScaler`` the job has but left out is named in a warning on rank 0 at the first
            :meth:`resume` and the first save (once each). An object with a
            ``before_checkpoint(runtime, step)`` method gets it called on every rank at the
            start of each save (it may be a collective, e.g. folding per-rank sums so that rank
            0's copy is everyone's).
        keep_last: complete checkpoints to keep (older ones are deleted by rank 0), >= 1.
        every_steps: :meth:`maybe_save` saves when ``step % every_steps == 0`` (0 = never);
            it also saves, and stops, at a step the ranks agreed to stop at after a signal.
        every_epochs: :meth:`maybe_save_epoch` saves after every this many epochs (0 = never).
        extra: JSON settings written to the manifest (batch size, lr, ...); :meth:`resume`
            refuses a checkpoint whose settings differ (see :func:`check_compatible`).
        async_save: write sharded state (``fsdp``, ``zero1``) in a background thread
            (torch's ``dcp.async_save``), committed at the next save, resume or :meth:`wait`
            (see :mod:`ddpkit.checkpoint.async_save`). Off by default; replicated-only state is
            always written synchronously.
        unsafe_pickle: resume by unpickling any object (a checkpoint holding objects of your
            own that you wrote and trust). UNSAFE: a checkpoint folder anyone else could write
            then runs their code. Default: only tensors, numbers, strings, containers and
            numpy arrays load (:mod:`ddpkit.security.safe_load`); anything else is refused
            in one line naming the class (allow it with
            ``torch.serialization.add_safe_globals``).

    Rank 0 takes ``directory``'s lock while the manager lives (not in live fault-tolerance
    mode): a second job on the same folder is refused (:mod:`ddpkit.checkpoint.lock`).

    Raises:
        ConfigError: ``keep_last < 1``, or a negative ``every_steps``/``every_epochs``; on rank
            0: another job holds ``directory``'s lock (named), or it cannot be created or
            written.
        TypeError: ``state`` is not a dict of objects with ``state_dict``/``load_state_dict``,
            or ``extra`` holds a non-JSON value (on every rank, before anything happens).

    Example:
        >>> ckpt = CheckpointManager("ckpt", rt, state={"model": model, "optimizer": opt})
        >>> step = ckpt.resume()  # 0 when there is no checkpoint yet
        >>> ckpt.save(step + 1)
        PosixPath('ckpt/step-00000001')
    """

    def __init__(
        self,
        directory: str | Path,
        runtime: Runtime,
        *,
        state: Mapping[str, Any] | None = None,
        keep_last: int = KEEP_LAST,
        every_steps: int = 0,
        every_epochs: int = 0,
        extra: Mapping[str, Any] | None = None,
        async_save: bool = False,
        unsafe_pickle: bool = False,
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
        self.unsafe_pickle = unsafe_pickle
        self.save_s = 0.0  # seconds spent in save() so far (the goodput's checkpoint time)
        self._newest: tuple[int, Path] | None = None  # the newest complete checkpoint known
        self._unreadable: dict[str, str] = {}  # folder name -> why the last resume skipped it
        self.every_epochs = every_epochs
        self.async_save = async_save
        self._async: AsyncShardedSaves | None = None
        self._forgotten = ForgottenStateCheck()  # a scheduler/scaler left out of state
        if runtime.live is None and runtime.is_rank_zero:  # one job per folder
            lock_directory(self.directory, self)
        if runtime.live is not None:  # a replacement heals from this state, sent live
            runtime.live.heal_source = self._heal_payload
            runtime.live.heal_local = rng_state
            runtime.live.heal_sink = self._healed
            runtime.live.heal_unsafe_pickle = unsafe_pickle

    def _known(self, step: int, folder: Path, *, committed: bool = True) -> None:
        """Note the newest checkpoint (``committed``: complete on disk; an asynchronous save
        is announced once :class:`AsyncShardedSaves` commits it)."""
        self._newest = (step, folder)
        if committed:
            self._committed(folder)

    def _committed(self, folder: Path) -> None:
        """Tell a stop now (a second signal) and the launcher the newest complete checkpoint."""
        if self.runtime.stop is not None:
            self.runtime.stop.newest_checkpoint = folder
        if self.runtime.is_rank_zero:
            note_checkpoint(folder)  # the launcher's failure line names it

    def _managed(self, action: str) -> dict[str, Any]:
        if not self.state:
            raise ConfigError(
                f"CheckpointManager.{action}(): the manager holds no state. Pass what to "
                "checkpoint once, when you build it: CheckpointManager(directory, runtime, "
                "state={'model': model, 'optimizer': optimizer, ...})."
            )
        return self.state

    def _check_forgotten(self, occasion: str) -> None:
        """Rank 0, at the first resume and the first save: warn of a used LR scheduler or
        GradScaler left out of the state (see :mod:`ddpkit.checkpoint.forgotten`)."""
        if self.runtime.is_rank_zero:
            self._forgotten.run(self.state, occasion)

    def save(self, step: int) -> Path:
        """Write checkpoint ``step`` of the managed state; returns its folder once complete.

        Collective: call on every rank at the same step. One all-gather brings every rank's RNG
        state and the checksums of its replicated state to every rank (see
        :mod:`ddpkit.checkpoint.consistency`); rank 0 alone writes (atomically: a failure at
        any point leaves no folder behind), then one all-reduce tells every rank whether it
        succeeded, so all return once the checkpoint is complete or all raise. At world size 1
        it writes without any collective. Sharded state (an ``fsdp`` model and its optimizer, a
        ``ZeroRedundancyOptimizer``) is written by every rank, its own shard, through
        ``torch.distributed.checkpoint`` into the same folder, committed by rank 0 once every
        rank succeeded (see :mod:`ddpkit.checkpoint.sharded`). With ``async_save`` the shards
        are written in the background and the folder returned appears at the next save, resume
        or :meth:`wait` (see :mod:`ddpkit.checkpoint.async_save`).

        Args:
            step: the optimizer step; names the folder ``step-XXXXXXXX``.

        Raises:
            ConfigError: the manager was built without ``state``.
            ReplicaDivergenceError: a module's parameters differ across ranks (nothing is
                written). Other replicated state that differs is saved from rank 0 with a
                warning naming it and the ranks, and listed in the manifest.
            DistributedError: rank 0 failed to write (raised on the other ranks; rank 0
                raises its own error); a sharded save failed on some rank (every rank raises,
                naming it).

        Example:
            >>> ckpt.save(step)
            PosixPath('ckpt/step-00000100')
        """
        if self.runtime.live is not None and self.runtime.live.quorum is not None:
            # a member lost mid-save: the save starts over on the members that remain
            return self.runtime.live.run("checkpoint save", lambda: self._save(step))
        return self._save(step)

    def _save(self, step: int) -> Path:
        managed, start = self._managed("save"), time.perf_counter()
        self._check_forgotten("save")
        for obj in managed.values():  # every rank, in the same order: they may be collectives
            if callable(getattr(obj, "before_checkpoint", None)):
                obj.before_checkpoint(self.runtime, step)
        sharded = sharded_entries(managed, self.runtime)  # through DCP: every rank its shard
        digests = replicated_digests(managed) if self.runtime.process_group is not None else {}
        gathered = all_gather_object({"rng": rng_state(), "digests": digests}, self.runtime)
        found = differences([g["digests"] for g in gathered])
        raise_if_parameters_differ(found, step)
        folder, error = self.directory / checkpoint_dir_name(step), None

        def replicated() -> dict[str, Any]:  # on rank 0: what it alone writes, in state.pt
            if found:
                log.warning(describe(found, folder.name, _notes(managed)))
            return {
                "state": {n: _module_or_state(o) for n, o in managed.items() if n not in sharded},
                "rng_per_rank": [g["rng"] for g in gathered],
            }

        if sharded and self.async_save:
            self._async = self._async or AsyncShardedSaves(self.runtime, self._committed)
            folder = self._async.start(
                self.directory,
                managed,
                sharded,
                step,
                replicated=replicated,
                meta=self._meta(found),
                prune=self._prune,
            )
        elif sharded:
            folder = save_sharded(
                self.runtime,
                self.directory,
                managed,
                sharded,
                step,
                replicated=replicated,
                meta=self._meta(found),
                prune=self._prune,
            )
        else:
            if self.runtime.is_rank_zero:
                try:
                    folder = self._write(step, replicated(), found)
                except Exception as exc:  # noqa: BLE001 - every rank must learn of it
                    error = exc
            self._agree_written(step, error)
        self._known(step, folder, committed=not (sharded and self.async_save))
        self.save_s += time.perf_counter() - start
        if self.runtime.live is not None and self.runtime.is_rank_zero:
            self.runtime.live.record_checkpoint(step, str(folder))
        return folder

    def wait(self) -> Path | None:
        """Commit the asynchronous save still in flight (``async_save=True``); returns its
        folder, ``None`` when there is none. Call it on every rank before the job ends: a save
        not waited for stays a ``.tmp-`` folder, and a resume uses the previous checkpoint.

        Collective: call on every rank (a no-op everywhere when nothing is in flight).

        Raises:
            DistributedError: a rank failed to write its shard (nothing is committed).
        """
        return self._async.finish() if self._async is not None else None

    def _meta(self, found: dict) -> dict[str, Any]:
        """What the manifest records besides the files: world size, settings, differences."""
        meta: dict[str, Any] = {"world_size": self.runtime.world_size, "extra": self.extra}
        if found:
            meta["differs_across_ranks"] = {s: list(ranks) for s, ranks in found.items()}
        return meta

    def _write(self, step: int, state: dict, found: dict) -> Path:
        """Rank 0: write the folder atomically, then prune older ones."""
        state.update(step=step, world_size=self.runtime.world_size, extra=self.extra)
        folder = write_checkpoint(self.directory, step, state, self._meta(found))
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
        if error is not None:  # recorded before the peers hear of it: once they have raised,
            record_failure(error)  # torchrun may stop this rank before its own exit records it
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
        self.wait()  # an asynchronous save in flight is committed before the job stops
        stop = self.runtime.stop
        assert stop is not None and stop.agreed is not None
        return TrainingStopped(
            stop.agreed, step=step, checkpoint=folder, saved=fresh, here=stop.agreed_here
        )

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
        self._unreadable = {}
        for folder in list_checkpoints(self.directory):
            try:
                return folder, load_checkpoint(folder, unsafe_pickle=self.unsafe_pickle)
            except DataError as exc:
                self._unreadable[folder.name] = str(exc)
                log.warning(
                    "skipping checkpoint %s: %s Falling back to the previous one.", folder.name, exc
                )
        return None

    def resume(self, path: str | Path | None = None) -> int:
        """Restore the newest complete checkpoint (or ``path``) into the managed state; returns
        its step, 0 if there is none (the state is left as it is).

        Storages are mapped to CPU, then each tensor goes to the device of the object it is
        loaded into (never every rank onto cuda:0). Checkpoints newer than the one resumed (skipped
        as unreadable, or an abandoned future when ``path`` names an older one) are moved by rank
        0 into ``DIRECTORY/set-aside/`` with a warning naming where, never deleted, so later
        saves and ``resume`` calls never mix two histories and a checkpoint that failed to read
        once (a transient error) is still there. Also when none could be read (the resume starts
        at 0). Nothing in the checkpoint runs code: only allowed
        types are unpickled (see ``unsafe_pickle``). Sharded state is resharded for this world size
        by ``torch.distributed.checkpoint``; a ``ZeroRedundancyOptimizer`` of an older checkpoint
        takes its own shard of the consolidated state (on any number of ranks).

        Another world size resumes too: replicated state loads as it is, a
        :class:`~ddpkit.ShardedLoader` re-shards the rest of its epoch over the new ranks (each
        remaining sample once), RNG states follow :mod:`ddpkit.checkpoint.rng`, and the info
        line names both sizes. Keeping the global batch is the caller's
        (:func:`ddpkit.fit_global_batch`).

        Collective: call on every rank; the ranks check they resumed the same checkpoint. At
        world size 1 no collective runs.

        Args:
            path: a ``step-XXXXXXXX`` folder to resume instead of the newest complete one.

        Raises:
            ConfigError: the manager was built without ``state``; the checkpoint was written
                with other settings (see :func:`check_compatible`); a loader position that
                cannot go on at this world size (a stream inside an epoch, see
                :meth:`ShardedLoader.load_state_dict`), raised before anything is loaded.
            DataError: ``path`` is corrupt or incomplete; a managed object has no state in the
                checkpoint.
            DistributedError: the ranks found different newest checkpoints.

        Example:
            >>> step = ckpt.resume()  # the newest complete checkpoint's step, or 0
        """
        self._managed("resume")
        self._check_forgotten("resume")
        live = self.runtime.live
        if live is not None and live.quorum is None:  # a replacement: healed from a live peer
            live.join_as_replacement()
            log.info(
                "healed from a live peer at step %d (quorum %d, world size %d)",
                live.step,
                live.quorum.number if live.quorum else 0,
                self.runtime.world_size,
            )
            return live.step
        step = self._resume(path)
        if live is not None:
            live.step = step
        return step

    def _resume(self, path: str | Path | None) -> int:
        self.wait()  # an asynchronous save in flight is committed first
        self._unreadable = {}
        if path is not None:
            found: tuple[Path, dict[str, Any]] | None = (
                Path(path),
                load_checkpoint(Path(path), unsafe_pickle=self.unsafe_pickle),
            )
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
            self._set_aside_newer_than(-1)  # every one unreadable: kept aside, never pruned
            return 0
        folder, state = found
        manifest = read_manifest(folder)
        check_compatible(folder, manifest, self.extra)
        note = self._restore(folder, state, int(manifest.get("world_size") or 0))
        barrier(self.runtime)  # every rank has read it before newer ones are moved away
        self._set_aside_newer_than(int(state["step"]))
        barrier(self.runtime)
        self._known(int(state["step"]), folder)
        log.info("resumed from %s (step %d)%s", folder, state["step"], note)
        return int(state["step"])

    def _set_aside_newer_than(self, step: int) -> None:
        """Rank 0: move the checkpoints newer than ``step`` (skipped as unreadable, or an
        abandoned future) into ``DIRECTORY/set-aside/``, out of the way of later saves and
        resumes but never deleted: an unreadable one may have been a transient read error."""
        if not self.runtime.is_rank_zero:
            return
        for newer in list_checkpoints(self.directory):
            if int(newer.name[5:]) <= step:
                continue
            reason = self._unreadable.get(newer.name)
            why = f"unreadable: {reason}" if reason else f"newer than the resumed step {step}"
            try:
                aside = set_aside(newer, self.directory / SET_ASIDE)
            except OSError as exc:  # rank 0 alone: never fail here while the peers wait
                log.warning(
                    "checkpoint %s (%s) could not be moved aside (%s) and stays where it is: "
                    "move or delete it before the next resume.",
                    newer.name,
                    why,
                    exc,
                )
                continue
            log.warning(
                "checkpoint %s (%s) moved to %s: nothing was deleted; resume it with "
                "resume(path) once it reads again, or delete it when you no longer need it.",
                newer.name,
                why,
                aside,
            )

    def _heal_payload(self) -> dict[str, Any]:
        """Live fault tolerance, on the member that heals a replacement: the managed state as a
        checkpoint would hold it (modules unwrapped), the step and the newest checkpoint."""
        assert self.runtime.live is not None
        return {
            "step": self.runtime.live.step,
            "state": {n: _module_or_state(o) for n, o in self._managed("heal").items()},
            "newest": None if self._newest is None else [self._newest[0], str(self._newest[1])],
        }

    def _healed(self, payload: dict[str, Any], rng_by_rank: list[Any], rank: int) -> None:
        """Live fault tolerance, on a replacement taking ``rank``: load the state a live peer
        sent (as :meth:`_restore` loads a checkpoint), and RNG states as a resume on another
        world size sets them (from the survivors', :mod:`ddpkit.checkpoint.rng`)."""
        managed, saved = self._managed("heal"), payload["state"]
        check_saved_state(Path("(a live peer)"), saved, managed)
        loaders = [n for n, obj in managed.items() if isinstance(obj, ShardedLoader)]
        modules = [n for n, o in managed.items() if isinstance(o, torch.nn.Module)]
        for name in loaders:
            managed[name].load_state_dict(saved[name])
        for name in modules:
            load_model_state(managed[name], saved[name])
        for name in managed:
            if name not in loaders + modules:
                managed[name].load_state_dict(saved[name])
        survivors = [r for r in rng_by_rank if r is not None]  # by rank: survivors come first
        restore_rng_state(survivors, rank, len(rng_by_rank), step=int(payload["step"]))
        if payload["newest"] is not None:
            self._known(int(payload["newest"][0]), Path(payload["newest"][1]))
        assert self.runtime.live is not None
        self.runtime.live.step = int(payload["step"])

    def _restore(self, folder: Path, state: dict[str, Any], saved_world_size: int) -> str:
        """Load every managed object and this rank's RNG states; returns the log's note on a
        resume at another world size ("" at the same one).

        Loaders go first (their state is checked before anything else changes), then modules,
        then the rest (optimizers after the parameters they hold state for).
        """
        managed = self.state
        saved = _saved_state(folder, state)
        sharded = state.get("sharded", {})  # restored through DCP, resharded
        check_saved_state(folder, {**dict.fromkeys(sharded), **saved}, managed)
        check_layouts(folder, managed, sharded, set(saved))
        rng_per_rank = state["rng_per_rank"]
        saved_world_size = saved_world_size or len(rng_per_rank)
        world_size = self.runtime.world_size
        loaders = [n for n, obj in managed.items() if isinstance(obj, ShardedLoader)]
        modules = [n for n, o in managed.items() if isinstance(o, torch.nn.Module) and n in saved]
        rest = [n for n in managed if n not in loaders + modules and n in saved]
        for name in modules:  # a model that changed: one line, before anything is loaded
            check_module_fits(folder, name, managed[name], saved[name])
        for name in loaders:  # an old state has no world size: it is the manifest's
            managed[name].load_state_dict({"world_size": saved_world_size, **saved[name]})
        for name in modules:
            load_model_state(managed[name], saved[name])
        if sharded:  # the sharded model and optimizers, resharded (one collective)
            load_sharded(self.runtime, folder, managed, sharded, self.unsafe_pickle)
        for name in rest:
            changed = optimizer_changes(managed[name], saved[name])
            managed[name].load_state_dict(saved[name])
            if changed and self.runtime.is_rank_zero:
                log.warning(
                    "resuming %s: state[%r]'s settings differ from the checkpoint's (%s); the "
                    "checkpoint's are restored (torch's load_state_dict). To train with yours, "
                    "set them in %s.param_groups after resume().",
                    folder.name,
                    name,
                    "; ".join(changed),
                    name,
                )
        rng = restore_rng_state(rng_per_rank, self.runtime.rank, world_size, step=state["step"])
        if saved_world_size == world_size:
            return ""
        return (
            f" on {world_size} ranks, written by {saved_world_size}: the data goes on at the "
            f"saved sample of its epoch, re-sharded over {world_size} ranks; {rng}"
        )
