"""What a checkpoint manager accepts, checked before anything is written or communicated.

- ``extra``: JSON settings, written to the manifest and compared on resume (batch size, ...).
- ``state``: ``{name: object}``, everything the manager saves and resumes (model, optimizer,
  scheduler, scaler, loader, an EMA copy, ``torch.optim.swa_utils.AveragedModel``, a metric
  tracker): anything with ``state_dict()`` and ``load_state_dict()``, the protocol torch calls
  ``Stateful``.
- a ``torch.distributed.optim.ZeroRedundancyOptimizer``: its state is sharded, one part per
  rank; a save first consolidates it on rank 0 (a collective), a resume gives each rank its part.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddpkit.errors import DataError
from ddpkit.log import get_logger
from ddpkit.parallel.zero import is_zero_optimizer

__all__ = [
    "LOCAL_SGD_NOTE",
    "check_extra",
    "check_saved_state",
    "check_state",
    "is_local_sgd_optimizer",
    "is_zero_optimizer",
]

log = get_logger("checkpoint")


def check_extra(extra: Mapping[str, Any] | None) -> None:
    """Raise unless every value of ``extra`` is JSON (it goes into ``manifest.json``).

    Raises:
        TypeError: names the key and its type, and where non-JSON state goes instead.
    """
    for key, value in (extra or {}).items():
        try:
            json.dumps(value, allow_nan=True)
        except (TypeError, ValueError):
            raise TypeError(
                f"checkpoint extra[{key!r}] is a {type(value).__name__}: extra holds JSON "
                "settings (numbers, strings, lists, dicts) written to the manifest and compared "
                f"on resume. Pass state with state_dict()/load_state_dict() as "
                f"state={{{key!r}: ...}} (a tensor: keep it in an nn.Module buffer or your own "
                "object), or store a JSON form (tensor.tolist())."
            ) from None


def check_state(state: Mapping[str, Any] | None) -> dict[str, Any]:
    """The manager's ``{name: object}`` without its ``None`` values, once each entry is checked.

    Raises:
        TypeError: ``state`` is not a dict, or names the entry that is not a str name and an
            object with ``state_dict()``/``load_state_dict()``.
    """
    if state is not None and not isinstance(state, Mapping):
        raise TypeError(
            f"checkpoint state is a {type(state).__name__}: pass a dict {{name: object with "
            "state_dict()/load_state_dict()}, e.g. state={'model': model, 'optimizer': opt}."
        )
    for name, obj in (state or {}).items():
        if obj is not None and (
            not isinstance(name, str)
            or not all(callable(getattr(obj, m, None)) for m in ("state_dict", "load_state_dict"))
        ):
            raise TypeError(
                f"checkpoint state[{name!r}] is a {type(obj).__name__}: each entry must be "
                "a str name and an object with state_dict() and load_state_dict() (an "
                "nn.Module, an optimizer, torch.optim.swa_utils.AveragedModel, your own class). "
                "Wrap a bare tensor in such an object."
            )
    return {name: obj for name, obj in (state or {}).items() if obj is not None}


def check_saved_state(folder: Path, saved: Mapping[str, Any], state: Mapping[str, Any]) -> None:
    """Before a resume loads anything: each object managed has state in the checkpoint.

    State saved but not managed is not restored: a warning names it.

    Raises:
        DataError: an object managed has no state in the checkpoint.
    """
    missing = [name for name in state if name not in saved]
    if missing:
        raise DataError(
            f"checkpoint {folder} has no state for "
            f"{', '.join(f'state[{n!r}]' for n in missing)} (it holds "
            f"{sorted(saved) or 'none'}). Manage the objects it was saved with, or leave the new "
            "one out of CheckpointManager(state=...) to start it fresh."
        )
    left = [name for name in saved if name not in state]
    if left:
        log.warning(
            "checkpoint %s holds state not restored: %s. Add them to CheckpointManager(state=...) "
            "to restore them.",
            folder.name,
            ", ".join(f"state[{n!r}]" for n in left),
        )


LOCAL_SGD_NOTE = (
    "Local SGD averages parameters only: each rank's optimizer state (momentum, Adam moments) "
    "follows its own gradients by design, so a resumed local-SGD run is not bit-exact."
)


def is_local_sgd_optimizer(optimizer: Any) -> bool:
    """True for torch's ``PostLocalSGDOptimizer`` (what :func:`ddpkit.enable_local_sgd`
    returns), looked up without importing it (see :func:`is_zero_optimizer`)."""
    module = sys.modules.get("torch.distributed.optim.post_localSGD_optimizer")
    local_sgd = getattr(module, "PostLocalSGDOptimizer", None)
    return local_sgd is not None and isinstance(optimizer, local_sgd)
