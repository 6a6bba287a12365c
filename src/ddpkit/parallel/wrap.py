"""Wrap a model for a strategy, and unwrap it for saving and evaluation.

Strategies:
- ``single``: the model on this rank's device, no gradient sync (world size 1).
- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` over the runtime's training group; its
  gradient buckets all-reduce during backward (overlap), tuned by ``bucket_cap_mb``.
- ``auto``: ``ddp`` when the world size is above 1, else ``single``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from ddpkit.distributed.process_group import Runtime
from ddpkit.errors import ConfigError, DistributedError

STRATEGIES = ("auto", "single", "ddp")
_WRAPPERS = (DistributedDataParallel, DataParallel)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside any DDP/DataParallel wrappers (its keys lack ``module.``)."""
    while isinstance(model, _WRAPPERS):
        model = model.module
    return model


def wrap_model(
    model: nn.Module, runtime: Runtime, strategy: str = "auto", **ddp_kwargs: Any
) -> nn.Module:
    """Move ``model`` to the rank's device and wrap it for ``strategy``.

    Collective (for ``ddp``): call on every rank; DDP broadcasts rank 0's parameters and buffers,
    so all replicas start identical.

    Args:
        model: an unwrapped ``nn.Module``.
        runtime: the job's :class:`Runtime`.
        strategy: ``auto``, ``single`` or ``ddp``.
        **ddp_kwargs: passed to ``DistributedDataParallel`` (``bucket_cap_mb``,
            ``find_unused_parameters``, ``static_graph``, ...).

    Returns:
        The wrapped model (the same module, moved, for ``single``).

    Raises:
        ConfigError: unknown strategy; the model is already wrapped; ``ddp`` options for
            ``single``.
        DistributedError: ``ddp`` asked for without a process group (world size 1).

    Example:
        >>> ddp_model = wrap_model(Net(), runtime, "ddp", bucket_cap_mb=25)   # doctest: +SKIP
    """
    if strategy not in STRATEGIES:
        raise ConfigError(
            f"unknown strategy: strategy={strategy!r}. Allowed: {', '.join(STRATEGIES)}."
        )
    if isinstance(model, _WRAPPERS):
        raise ConfigError(
            f"model is already wrapped in {type(model).__name__}: wrapping twice would sync "
            "gradients twice. Pass the plain module (ddpkit.unwrap_model(model))."
        )
    if strategy == "auto":
        strategy = "ddp" if runtime.world_size > 1 else "single"
    model = model.to(runtime.device)
    if strategy == "single":
        if ddp_kwargs:
            raise ConfigError(
                f"DDP options {sorted(ddp_kwargs)} given for strategy='single'. "
                "Drop them or use strategy='ddp'."
            )
        return model
    if runtime.process_group is None:
        raise DistributedError(
            "strategy='ddp' needs a process group, and world_size=1 has none. Launch several "
            "processes (ddpkit run -n 2 ... / torchrun), or use strategy='single'."
        )
    device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
    return DistributedDataParallel(
        model, device_ids=device_ids, process_group=runtime.process_group, **ddp_kwargs
    )


def model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the unwrapped model: keys never start with ``module.``."""
    return unwrap_model(model).state_dict()
