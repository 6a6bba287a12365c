"""RNG states on resume at another world size: which saved stream each new rank continues.

A checkpoint holds every rank's RNG states (torch CPU, CUDA, numpy, python; see
:func:`~ddpkit.checkpoint.state.rng_state`). On the world size that wrote them, rank ``r`` takes
saved rank ``r``'s states and the resume is exact. On another world size the streams cannot map
one to one, so each generator is decided on its own: one that every saved rank held in the same
state (torch's, in the usual job that seeds every rank alike and draws alike) goes on on every
rank, exactly as every rank of the uninterrupted run would have drawn next; one that differs
across the saved ranks (numpy's and python's where nothing seeds them, or per-rank seeds) goes on
on rank ``r`` from saved rank ``r``'s state where there is one, and a new rank seeds it from
``(step, rank, generator)``, distinct per rank and the same on a rerun; the states of saved ranks
beyond the new world size are dropped.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from ddpkit.checkpoint.state import set_rng_state
from ddpkit.data.seeding import derive_seed


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _seed(generator: str, seed: int) -> None:
    if generator == "torch":
        torch.default_generator.manual_seed(seed)
    elif generator == "numpy":
        np.random.seed(seed % 2**32)
    elif generator == "python":
        random.seed(seed)
    elif generator == "cuda" and torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def _ranks(first: int, last: int) -> str:
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


def restore_rng_state(saved: list[dict[str, Any]], rank: int, world_size: int, *, step: int) -> str:
    """Set this rank's RNG states from a checkpoint's per-rank ``saved`` states (the rule in the
    module docstring); returns how, for the resume's log line. Not a collective.

    Args:
        saved: every saved rank's :func:`~ddpkit.checkpoint.state.rng_state`, by rank.
        rank: this rank; world_size: this job's number of ranks.
        step: the checkpoint's step, which seeds the generators of new ranks.
    """
    if len(saved) == world_size:
        set_rng_state(saved[rank])
        return "each rank continues its own RNG state"
    keys = [k for k in saved[0] if all(k in other for other in saved)]
    shared = [k for k in keys if all(_same(saved[0][k], other[k]) for other in saved[1:])]
    own = [k for k in keys if k not in shared]
    kept = min(len(saved), world_size)
    state = {k: saved[0][k] for k in shared}
    if rank < kept:
        state.update({k: saved[rank][k] for k in own})
    else:
        for k in own:
            _seed(k, derive_seed("resume-rng", step, rank, k))
    set_rng_state(state)
    said = [f"{', '.join(shared)} as the {len(saved)} saved ranks shared it"] if shared else []
    if own:
        rest = (
            f"{_ranks(kept, world_size - 1)} seeded from (step, rank)"
            if world_size > kept
            else f"saved {_ranks(kept, len(saved) - 1)} dropped"
        )
        said.append(f"{', '.join(own)} per rank ({_ranks(0, kept - 1)} their own, {rest})")
    return "RNG states: " + "; ".join(said)
