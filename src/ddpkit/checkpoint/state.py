"""What goes into a checkpoint besides the objects' own state dicts: RNG states, model loading."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from ddpkit.errors import DataError
from ddpkit.parallel.wrap import unwrap_model


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
