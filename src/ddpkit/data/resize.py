"""Resuming on another number of ranks: the global batch kept, and the world sizes that allow it.

The global batch is ``per-rank batch x micro-steps x world_size``: the samples that make one
optimizer step. A checkpoint written on W ranks resumes on M ranks with the same optimizer
steps only if each step still trains on that many samples; :func:`fit_global_batch` picks the
per-rank batch and the micro-steps that keep it, or names the world sizes that can.
"""

from __future__ import annotations

from ddpkit.errors import ConfigError

__all__ = ["fit_global_batch", "world_sizes_for"]

_MAX_LISTED = 16


def world_sizes_for(global_batch_size: int) -> list[int]:
    """The world sizes that can split ``global_batch_size`` evenly: its divisors, ascending."""
    small = [d for d in range(1, int(global_batch_size**0.5) + 1) if global_batch_size % d == 0]
    return sorted(set(small + [global_batch_size // d for d in small]))


def _listed(sizes: list[int]) -> str:
    more = f" and {len(sizes) - _MAX_LISTED} larger" if len(sizes) > _MAX_LISTED else ""
    return ", ".join(str(s) for s in sizes[:_MAX_LISTED]) + more


def _positive(name: str, value: object) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"{name}={value!r}"
    return None


def fit_global_batch(
    global_batch_size: int, world_size: int, *, batch_size: int
) -> tuple[int, int]:
    """The per-rank batch size and micro-steps that make ``global_batch_size`` on ``world_size``.

    ``per-rank batch x micro-steps x world_size == global_batch_size``, with the largest per-rank
    batch that is at most ``batch_size`` (so a rank's memory never grows) and divides
    ``global_batch_size / world_size``; the micro-steps make up the rest. Where ``batch_size``
    itself divides it, the per-rank batch is kept and only the accumulation changes: on the world
    size the global batch was set for, ``(batch_size, micro-steps)`` come back unchanged. Not a
    collective; world size 1 is a size like any other (the whole batch in micro-steps).

    Args:
        global_batch_size: samples per optimizer step over all ranks and micro-steps.
        world_size: the number of ranks to run on.
        batch_size: the largest per-rank batch to use (samples per rank per micro-step).

    Returns:
        ``(batch_size, num_micro_steps)`` for ``world_size``.

    Raises:
        ConfigError: an argument is not a positive integer; ``world_size`` does not divide
            ``global_batch_size`` (the message lists the world sizes that do).

    Example:
        >>> fit_global_batch(128, 4, batch_size=64)   # written on 2 ranks x 64, resumed on 4
        (32, 1)
        >>> fit_global_batch(128, 1, batch_size=64)
        (64, 2)
    """
    bad = [
        p
        for p in (
            _positive("global_batch_size", global_batch_size),
            _positive("world_size", world_size),
            _positive("batch_size", batch_size),
        )
        if p
    ]
    if bad:
        raise ConfigError(
            f"invalid global batch: {', '.join(bad)}. Each must be a positive integer "
            "(samples, ranks, samples per rank)."
        )
    if global_batch_size % world_size:
        raise ConfigError(
            f"cannot keep the global batch: global_batch_size={global_batch_size} does not "
            f"split over world_size={world_size} ranks (per-rank batch x micro-steps x world "
            f"size must equal it). Run on one of these numbers of ranks: "
            f"{_listed(world_sizes_for(global_batch_size))}; or start fresh."
        )
    per_rank = global_batch_size // world_size
    fitted = max(d for d in world_sizes_for(per_rank) if d <= batch_size)
    return fitted, per_rank // fitted
