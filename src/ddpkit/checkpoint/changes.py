"""What changed in the job since a checkpoint was written, found before a resume loads it.

- A module whose parameters or buffers no longer match the checkpoint's (a changed layer
  width, a renamed or removed layer) is refused in one line naming the checkpoint, the
  parameters with both shapes, and how to start fresh, before anything is loaded (torch's own
  ``load_state_dict`` raises a multi-line "size mismatch" naming neither).
- An optimizer whose hyper-parameters were edited (``lr=0.5`` where the checkpoint has 0.1) is
  named in one warning: torch's ``Optimizer.load_state_dict`` restores the checkpoint's
  ``param_groups`` with the state, so the checkpoint's values win. Values an LR scheduler
  moves every step (``lr``, ``momentum``, ``betas``) are compared only where no scheduler is
  attached (``initial_lr`` absent); with one, ``initial_lr`` and the rest are compared.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ddpkit.checkpoint.state import strip_wrapper_prefixes
from ddpkit.errors import DataError
from ddpkit.parallel.wrap import unwrap_model

SCHEDULED = ("lr", "momentum", "betas")  # moved by LR schedulers (OneCycleLR cycles momentum)
SHOWN = 3  # names listed per kind of difference


def _shape(value: Any) -> list[int] | None:
    return list(value.shape) if isinstance(value, torch.Tensor) else None


def _listed(items: list[str]) -> str:
    more = f" and {len(items) - SHOWN} more" if len(items) > SHOWN else ""
    return ", ".join(items[:SHOWN]) + more


def check_module_fits(folder: Path, name: str, module: torch.nn.Module, saved: dict) -> None:
    """Refuse a checkpoint whose ``saved`` state of ``state[name]`` does not fit ``module``.

    Not a collective; reads shapes only (no tensor is copied).

    Raises:
        DataError: parameters or buffers of other shapes, missing or unexpected ones: one line
            naming ``folder``, each kind with up to three names (shapes: checkpoint, model).
    """
    target = unwrap_model(module)
    current = target.state_dict()
    saved = strip_wrapper_prefixes(saved, set(current))
    reshaped = [
        f"{key} {_shape(value)} in the checkpoint, {_shape(current[key])} in the model"
        for key, value in saved.items()
        if key in current and _shape(value) != _shape(current[key])
    ]
    missing = [key for key in current if key not in saved]
    unexpected = [key for key in saved if key not in current]
    if not (reshaped or missing or unexpected):
        return
    parts = [
        f"{len(found)} {what}: {_listed(found)}"
        for what, found in (
            ("of another shape", reshaped),
            ("missing from the checkpoint", missing),
            ("not in the model", unexpected),
        )
        if found
    ]
    raise DataError(
        f"checkpoint {folder} does not fit state[{name!r}] ({type(target).__name__}): "
        f"{'; '.join(parts)}. The model changed since it was saved: resume with the model it "
        "was saved from, or start fresh in another checkpoint folder (ddpkit train: another "
        "--output-dir, or --overwrite)."
    )


def optimizer_changes(optimizer: Any, saved: Any) -> list[str]:
    """The hyper-parameters of ``optimizer`` that differ from its ``saved`` state dict, as
    ``"lr 0.5 here, 0.1 in the checkpoint"`` (group index added past one group); none for an
    object that is not a ``torch.optim.Optimizer``. Not a collective; call it before
    ``load_state_dict``, which replaces them with the saved ones."""
    if not (isinstance(optimizer, torch.optim.Optimizer) and isinstance(saved, dict)):
        return []
    changes = []
    groups = saved.get("param_groups", [])
    for index, (now, then) in enumerate(zip(optimizer.param_groups, groups, strict=False)):
        skip = {"params", *(SCHEDULED if "initial_lr" in now else ())}
        where = f" (group {index})" if len(groups) > 1 else ""
        for key in sorted(set(now) & set(then) - skip):
            mine, theirs = now[key], then[key]
            if isinstance(mine, torch.Tensor) or isinstance(theirs, torch.Tensor):
                mine, theirs = _plain(mine), _plain(theirs)
            if mine != theirs:
                changes.append(f"{key}{where} {mine!r} here, {theirs!r} in the checkpoint")
    return changes


def _plain(value: Any) -> Any:
    return value.tolist() if isinstance(value, torch.Tensor) else value
