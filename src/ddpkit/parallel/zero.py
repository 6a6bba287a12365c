"""``strategy="zero1"``: DDP plus torch's ``ZeroRedundancyOptimizer`` (ZeRO stage 1).

The model is wrapped in DDP exactly as for ``ddp`` (gradients all-reduced in buckets during
backward, every rank holding every parameter and gradient); the optimizer state is what is
sharded: ``ZeroRedundancyOptimizer`` gives each parameter to one rank (a greedy partition by
size), that rank alone keeps its optimizer state and steps it, then broadcasts the updated
parameter to the others. Per rank, optimizer state shrinks to about ``1/world_size``; gradient
traffic is DDP's, plus one broadcast of the parameters per step.

Build the optimizer with :func:`build_zero_optimizer`; :class:`~ddpkit.TrainStep` refuses a
``zero1`` model stepped by any other optimizer (the state would silently stay unsharded).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import torch

from ddpkit.log import get_logger
from ddpkit.runtime.process_group import Runtime


def is_zero_optimizer(optimizer: Any) -> bool:
    """True for a ``torch.distributed.optim.ZeroRedundancyOptimizer`` (sharded state).

    Looked up only when its module is already imported (an instance implies it is): importing
    ``torch.distributed.optim`` costs seconds, which every other user would pay.
    """
    module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    zero = getattr(module, "ZeroRedundancyOptimizer", None)
    return zero is not None and isinstance(optimizer, zero)


def build_zero_optimizer(
    params: Iterable[Any],
    runtime: Runtime,
    *,
    optimizer_class: type[torch.optim.Optimizer],
    **defaults: Any,
) -> torch.optim.Optimizer:
    """A ``ZeroRedundancyOptimizer`` of ``optimizer_class`` over the runtime's training group.

    Collective (world size 2+): call on every rank with the same parameters (torch's
    constructor partitions them; the ranks must agree on the list).

    At world size 1 there is nothing to shard: the plain ``optimizer_class(params,
    **defaults)`` is returned, said in one info line, so one script runs unchanged as
    ``python train.py`` and under a launcher.

    Args:
        params: the model's parameters (``model.parameters()``), or parameter groups (dicts).
        runtime: the job's :class:`~ddpkit.Runtime`.
        optimizer_class: the optimizer each rank runs on its shard (``torch.optim.AdamW``).
        **defaults: its arguments (``lr=3e-3``, ``weight_decay=0.01``, ...).

    Returns:
        The optimizer to step (and to give :class:`~ddpkit.CheckpointManager`, which saves
        each rank's shard through ``torch.distributed.checkpoint``).

    Example:
        >>> model = ddpkit.wrap_model(Net(), rt, strategy=ddpkit.ZeRO1())
        >>> opt = ddpkit.build_zero_optimizer(model.parameters(), rt,
        ...                                   optimizer_class=torch.optim.AdamW, lr=1e-3)
        >>> type(opt).__name__
        'ZeroRedundancyOptimizer'
    """
    if runtime.process_group is None:
        get_logger("parallel").info(
            "build_zero_optimizer: world_size=1, so the optimizer state is not sharded: a "
            "plain %s is returned.",
            optimizer_class.__name__,
        )
        return optimizer_class(params, **defaults)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    zero = ZeroRedundancyOptimizer(
        params, optimizer_class=optimizer_class, process_group=runtime.process_group, **defaults
    )
    # every hyperparameter, as optimizer_class fills them in (betas, eps, ...): ZeRO's groups
    # hold only those passed, and LR schedules that cycle momentum look for betas there
    for name, value in zero.optim.defaults.items():
        zero.defaults.setdefault(name, value)
        for group in zero.param_groups:
            group.setdefault(name, value)
    return zero
