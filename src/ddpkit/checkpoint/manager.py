"""Checkpoint manager: collective save by a single writer, exact resume, fallback on corruption.

What a checkpoint holds: the unwrapped model state (no ``module.`` prefix), optimizer, LR
scheduler and grad scaler states, the step and epoch, the sharded loader's position inside the
epoch, every rank's RNG states (torch, CUDA, numpy, python) and the world size. Resuming puts all
of them back, so a run stopped at step k and resumed ends bitwise equal to an uninterrupted run.

Example::

    ckpt = CheckpointManager("runs/ckpt", rt, keep_last=3, every_steps=100)
    step = ckpt.resume(model=model, optimizer=opt, scheduler=sched, loader=train_loader)
    while step < total_steps:
        for x, y in train_loader:
            ...; step += 1
            ckpt.maybe_save(step, model=model, optimizer=opt, scheduler=sched, loader=train_loader)
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ddpkit.checkpoint.io import MANIFEST, list_checkpoints, load_checkpoint, write_checkpoint
from ddpkit.distributed.collectives import barrier
from ddpkit.distributed.process_group import Runtime
from ddpkit.errors import ConfigError, DataError
from ddpkit.log import get_logger
from ddpkit.parallel.wrap import unwrap_model

log = get_logger("checkpoint")


def rng_state() -> dict[str, Any]:
    """This process's RNG states: torch CPU, CUDA (all devices), numpy, python."""
    state = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _gather(obj: Any, runtime: Runtime) -> list[Any]:
    if runtime.process_group is None:
        return [obj]
    out: list[Any] = [None] * runtime.world_size
    dist.all_gather_object(out, obj, group=runtime.process_group)
    return out


def load_model_state(
    model: torch.nn.Module, state: dict[str, torch.Tensor], strict: bool = True
) -> None:
    """Load a state dict saved with or without DDP's ``module.`` prefix.

    Raises:
        DataError: a non-strict load that matches no key at all (it would silently load nothing).
    """
    if state and all(key.startswith("module.") for key in state):
        state = {key[len("module.") :]: value for key, value in state.items()}
    target = unwrap_model(model)
    result = target.load_state_dict(state, strict=strict)
    if not strict and len(result.missing_keys) == len(target.state_dict()):
        raise DataError(
            f"checkpoint matches no parameter of {type(target).__name__}: "
            f"{len(result.unexpected_keys)} unexpected keys such as "
            f"{result.unexpected_keys[:3]}. Load it into the model it was saved from."
        )


class CheckpointManager:
    """Save and resume training state under ``directory``.

    Args:
        directory: where ``step-XXXXXXXX/`` folders go (on a filesystem every rank can read).
        runtime: the job's :class:`~ddpkit.Runtime`.
        keep_last: complete checkpoints to keep (older ones are deleted by rank 0), >= 1.
        every_steps: :meth:`maybe_save` saves when ``step % every_steps == 0`` (0 = never).
        every_epochs: :meth:`maybe_save_epoch` saves after every this many epochs (0 = never).

    Raises:
        ConfigError: ``keep_last < 1``, or a negative ``every_steps``/``every_epochs``.
    """

    def __init__(
        self,
        directory: str | Path,
        runtime: Runtime,
        keep_last: int = 3,
        every_steps: int = 0,
        every_epochs: int = 0,
    ) -> None:
        if keep_last < 1 or every_steps < 0 or every_epochs < 0:
            raise ConfigError(
                f"invalid checkpoint settings: keep_last={keep_last} (must be >= 1), "
                f"every_steps={every_steps}, every_epochs={every_epochs} (must be >= 0)."
            )
        self.directory = Path(directory)
        self.runtime = runtime
        self.keep_last = keep_last
        self.every_steps = every_steps
        self.every_epochs = every_epochs

    def save(
        self,
        step: int,
        *,
        model: torch.nn.Module,
        optimizer: Any = None,
        scheduler: Any = None,
        scaler: Any = None,
        loader: Any = None,
        extra: dict | None = None,
    ) -> Path:
        """Write checkpoint ``step``; returns its folder once it is complete on disk.

        Collective: call on every rank at the same step. Rank 0 alone writes (the state is
        replicated); every rank's RNG state is gathered to it first; all ranks return only after
        the checkpoint is complete (a barrier), so none races ahead of a half-written one.
        """
        rng_per_rank = _gather(rng_state(), self.runtime)
        folder = self.directory / f"step-{step:08d}"
        if self.runtime.is_rank_zero:
            state = {
                "model": unwrap_model(model).state_dict(),
                "optimizer": optimizer.state_dict() if optimizer is not None else None,
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "scaler": scaler.state_dict() if scaler is not None else None,
                "loader": loader.state_dict() if loader is not None else None,
                "rng_per_rank": rng_per_rank,
                "step": step,
                "world_size": self.runtime.world_size,
                "extra": extra or {},
            }
            folder = write_checkpoint(
                self.directory, step, state, {"world_size": self.runtime.world_size}
            )
            self._prune()
        barrier(self.runtime)
        return folder

    def maybe_save(self, step: int, **state: Any) -> Path | None:
        """:meth:`save` when ``every_steps`` divides ``step``. Collective like :meth:`save`."""
        if self.every_steps and step % self.every_steps == 0:
            return self.save(step, **state)
        return None

    def maybe_save_epoch(self, epoch: int, step: int, **state: Any) -> Path | None:
        """After epoch ``epoch`` (1-based) ends: :meth:`save` when ``every_epochs`` divides it.

        Collective like :meth:`save`; call it once the loader's pass is over, so the checkpoint
        resumes at the start of the next epoch.
        """
        if self.every_epochs and epoch % self.every_epochs == 0:
            return self.save(step, **state)
        return None

    def _prune(self) -> None:
        import shutil

        complete = [p for p in list_checkpoints(self.directory) if (p / MANIFEST).is_file()]
        for old in complete[self.keep_last :]:
            shutil.rmtree(old, ignore_errors=True)

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

    def resume(
        self,
        *,
        model: torch.nn.Module,
        optimizer: Any = None,
        scheduler: Any = None,
        scaler: Any = None,
        loader: Any = None,
        path: str | Path | None = None,
    ) -> int:
        """Restore the newest complete checkpoint (or ``path``); returns its step, 0 if none.

        Storages are mapped to CPU, then each tensor goes to the device of the object it is
        loaded into (never every rank onto cuda:0). Not a collective, but every rank must call
        it, since each restores its own RNG state.

        Raises:
            DataError: ``path`` is corrupt or incomplete; or the checkpoint was written by another
                world size (its RNG states and data positions are per rank).
        """
        found = (
            (Path(path), load_checkpoint(Path(path))) if path is not None else self.load_latest()
        )
        if found is None:
            return 0
        folder, state = found
        if state["world_size"] != self.runtime.world_size:
            raise DataError(
                f"checkpoint {folder} was written by world_size={state['world_size']}, this job "
                f"has world_size={self.runtime.world_size}. Resume with the same number of "
                f"processes (ddpkit run -n {state['world_size']} ...)."
            )
        load_model_state(model, state["model"])
        for obj, key in (
            (optimizer, "optimizer"),
            (scheduler, "scheduler"),
            (scaler, "scaler"),
            (loader, "loader"),
        ):
            if obj is not None and state[key] is not None:
                obj.load_state_dict(state[key])
        set_rng_state(state["rng_per_rank"][self.runtime.rank])
        log.info("resumed from %s (step %d)", folder, state["step"])
        return int(state["step"])
