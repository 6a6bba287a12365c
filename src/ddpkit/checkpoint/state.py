"""What goes into a checkpoint besides the objects' own state dicts: RNG states, model loading."""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from ddpkit.errors import ConfigError, DataError
from ddpkit.log import get_logger
from ddpkit.parallel.fsdp import is_fsdp
from ddpkit.parallel.wrap import unwrap_model

# what DDP/DataParallel (``module.``) and torch.compile (``_orig_mod.``) put before every key
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
_MAX_LISTED = 8

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
    """Set the generators ``state`` holds (any of :func:`rng_state`'s; CUDA only where there)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "python" in state:
        random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def strip_wrapper_prefixes(
    state: dict[str, Any], target_keys: set[str] | None = None
) -> dict[str, Any]:
    """``state`` without the ``module.``/``_orig_mod.`` prefixes that wrappers put before *every*
    key, in any nesting; a new dict (``state`` is left alone), torch's load metadata kept.

    A prefix is removed only while every key carries it and (when ``target_keys`` are given)
    the target's own keys do not, so a model with a submodule really named ``module`` loads too.
    """
    while state:
        prefix = next((p for p in WRAPPER_PREFIXES if all(k.startswith(p) for k in state)), None)
        if prefix is None or (target_keys and all(k.startswith(prefix) for k in target_keys)):
            return state
        copy: dict[str, Any] = OrderedDict(state)
        metadata = getattr(state, "_metadata", None)
        if metadata is not None:
            copy._metadata = OrderedDict(metadata)  # type: ignore[attr-defined]
        consume_prefix_in_state_dict_if_present(copy, prefix)  # torch's own helper
        state = copy
    return state


def _listed(keys: list[str]) -> str:
    more = f" and {len(keys) - _MAX_LISTED} more" if len(keys) > _MAX_LISTED else ""
    return f"{keys[:_MAX_LISTED]}{more}"


def load_model_state(
    model: torch.nn.Module, state: dict[str, torch.Tensor], *, strict: bool = True
) -> Any:
    """Load a state dict saved with or without wrapper prefixes into a wrapped or plain model.

    The ``module.`` (DDP, DataParallel) and ``_orig_mod.`` (``torch.compile``) prefixes are
    removed from the keys, and ``model`` is unwrapped the same way, so any of the four saves
    loads into any of the four models. Not a collective.

    Args:
        model: the model to load into (wrapped, compiled or plain).
        state: a state dict, e.g. ``torch.load("model.pt")``.
        strict: as in ``torch.nn.Module.load_state_dict``: every key must match. With
            ``strict=False`` a partial match loads what matches and never silently: the keys
            are returned and a warning says how many of the model's keys were loaded and
            lists the missing and unexpected ones.

    Returns:
        torch's ``(missing_keys, unexpected_keys)`` named tuple (both empty for a full match).

    Raises:
        RuntimeError: ``strict=True`` and the keys differ (torch's error, listing them).
        DataError: a non-strict load that matches no key at all (it would load nothing).
        ConfigError: ``model`` is an ``fsdp`` model (load before wrapping it).

    Example:
        >>> backbone = {k: v for k, v in model.state_dict().items() if ".head." not in k}
        >>> result = load_model_state(model, backbone, strict=False)  # "module." prefixes gone
        >>> result.missing_keys
        ['head.weight', 'head.bias']
    """
    target = unwrap_model(model)
    if is_fsdp(target):
        raise ConfigError(
            f"load_model_state into an fsdp model ({type(target).__name__}): its parameters are "
            "shards. Load the plain state dict into the module before wrap_model(..., "
            "strategy='fsdp'), or resume a sharded checkpoint with CheckpointManager."
        )
    target_keys = set(target.state_dict())
    state = strip_wrapper_prefixes(state, target_keys)
    result = target.load_state_dict(state, strict=strict)
    if strict or not (result.missing_keys or result.unexpected_keys):
        return result
    name = type(target).__name__
    if len(result.missing_keys) == len(target_keys):
        raise DataError(
            f"checkpoint matches no parameter of {name}: "
            f"{len(result.unexpected_keys)} unexpected keys such as "
            f"{result.unexpected_keys[:3]}. Load it into the model it was saved from."
        )
    if not result.missing_keys:
        log.warning(
            "load into %s: all %d keys loaded; %d keys of the state were ignored (unexpected %s).",
            name,
            len(target_keys),
            len(result.unexpected_keys),
            _listed(result.unexpected_keys),
        )
        return result
    log.warning(
        "partial load into %s: %d of %d keys loaded; missing %s; unexpected %s. The missing "
        "ones keep their current values; pass strict=True to make this an error.",
        name,
        len(target_keys) - len(result.missing_keys),
        len(target_keys),
        _listed(result.missing_keys),
        _listed(result.unexpected_keys),
    )
    return result
