"""Local SGD: each rank steps on its own gradients; parameters are averaged every H steps.

This is the correct form of "skip the all-reduce to go faster". Built from torch's pieces:
DDP's public ``DistributedDataParallel.no_sync()`` context is entered once and held open (by the
averager, as long as the optimizer lives), so backward leaves each rank's gradients local and
DDP's reducer does no work at all; ``PostLocalSGDOptimizer`` runs a
model averager after every optimizer step. The averager is a ``ModelAverager`` subclass (torch's
extension point) that averages with torch's ``average_parameters`` when the optimizer step count
is a multiple of H, and counts the bytes. Replicas may differ between averaging steps and are
identical right after each one; gradient traffic disappears and parameter traffic happens once
per H steps.

Why not torch's ``post_localSGD_hook``: it gives the same gradients (the hook hands each bucket
back unchanged when ``post_local_gradient_allreduce=False``), but DDP still copies every gradient
into its buckets, calls the Python hook per bucket and copies the buckets back, at every step.
On 2 CPU cores (MNIST CNN, H = 4, 7 interleaved rounds) the hook reached 0.911x the no-sync
ceiling and the held ``no_sync()`` 0.962x (docs/performance.md, section 3). With
``post_local_gradient_allreduce=True`` (torch's default) the hook would all-reduce gradients
inside an intra-node subgroup, which on one node is every rank (no saving).
Also off inside ``no_sync()``: DDP's buffer broadcast before forward, so buffers (BatchNorm
statistics) stay per rank. ``PeriodicModelAverager`` counts steps from 0 and averages after
steps 1, H + 1, ...; ddpkit's averager averages after steps H, 2H, ..., so a replica check
every N steps (N a multiple of H) always runs right after an averaging step.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging import averagers
from torch.distributed.algorithms.model_averaging import utils as averaging_utils
from torch.nn.parallel import DistributedDataParallel

from ddpkit.errors import ConfigError
from ddpkit.guards.grad_sync import mark_gradients_local
from ddpkit.parallel.comm import CommStats
from ddpkit.parallel.rules import (
    local_sgd_with_comm_hook,
    local_sgd_with_sharding,
    local_sgd_with_static_graph,
)
from ddpkit.parallel.strategy import wrapped_strategy
from ddpkit.parallel.zero import is_zero_optimizer
from ddpkit.runtime.process_group import Runtime

if TYPE_CHECKING:
    from torch.distributed.optim import PostLocalSGDOptimizer


class PeriodicAverager(averagers.ModelAverager):
    """Average parameters over the group after every ``period``-th optimizer step.

    Attributes:
        step: optimizer steps taken so far (saved by ``PostLocalSGDOptimizer.state_dict``).
        period: H, steps between averaging rounds.
        last_average_step: the step after which parameters were last averaged (0 = never).
    """

    def __init__(
        self, period: int, process_group: dist.ProcessGroup | None, stats: CommStats
    ) -> None:
        super().__init__(process_group)
        self.period = period
        self.stats = stats
        self.last_average_step = 0
        # DDP's no_sync() held open for the life of this averager (see enable_local_sgd)
        self.sync_off = contextlib.ExitStack()

    def average_parameters(self, params) -> None:
        """Count the step; average when it is a multiple of ``period``. Collective."""
        self.step += 1
        if self.step % self.period == 0:
            self.average_now(params)

    def average_now(self, params) -> None:
        """Average ``params`` (tensors or optimizer param groups) now. Collective.

        All parameters are averaged, with or without a gradient, so every rank sends the same.
        """
        tensors: list[torch.nn.Parameter] = []
        for item in params:
            tensors.extend(item["params"] if isinstance(item, dict) else [item])
        averaging_utils.average_parameters(iter(tensors), self.process_group)
        self.stats.averaging_bytes += sum(t.numel() * t.element_size() for t in tensors)
        self.stats.num_averages += 1
        self.last_average_step = self.step

    @property
    def just_averaged(self) -> bool:
        """True right after an averaging step (replicas are identical now)."""
        return self.last_average_step == self.step and self.step > 0


def enable_local_sgd(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    runtime: Runtime,
    sync_every: int,
    comm_stats: CommStats | None = None,
) -> PostLocalSGDOptimizer:
    """Turn a DDP model and its optimizer into local SGD with averaging every ``sync_every`` steps.

    Enters ``model.no_sync()`` (DDP's public switch) and holds it open for as long as the
    returned optimizer lives (``no_sync()`` blocks inside still work), and wraps the optimizer;
    use the returned optimizer for ``step``/``zero_grad``/checkpoints (its state dict also holds
    the averager's step). Averaging happens inside ``step()``.

    Collective: ``step()`` of the returned optimizer is one on averaging steps; call it on every
    rank at every step. Build an LR scheduler on the inner ``optimizer``.

    Args:
        model: a ``DistributedDataParallel`` model without a comm hook (gradients are no longer
            all-reduced, so a hook would never run).
        optimizer: the local optimizer over ``model``'s parameters.
        runtime: the job's runtime (its training process group averages).
        sync_every: H >= 2, optimizer steps between parameter averaging rounds.
        comm_stats: a :class:`CommStats` to count gradient and averaging bytes in (the same
            name as :func:`~ddpkit.wrap_model`'s).

    Returns:
        ``torch.distributed.optim.PostLocalSGDOptimizer``; ``.averager`` is a
        :class:`PeriodicAverager`.

    Raises:
        ConfigError: ``sync_every`` < 2 (1 is plain DDP), ``model`` is not DDP (``fsdp``), the
            strategy is ``zero1`` or the optimizer a ``ZeroRedundancyOptimizer``, or the model
            has a comm hook or ``static_graph=True``.

    Example:
        >>> ddp_model = wrap_model(Net(), rt)
        >>> opt = enable_local_sgd(ddp_model, torch.optim.SGD(ddp_model.parameters(), 0.1),
        ...                        runtime=rt, sync_every=4)
        >>> type(opt).__name__
        'PostLocalSGDOptimizer'
    """
    if not isinstance(sync_every, int) or sync_every < 2:
        raise ConfigError(
            f"invalid local SGD period: sync_every={sync_every!r}. It must be an integer >= 2 "
            "(1 means all-reduce every step: use plain DDP, i.e. do not call enable_local_sgd)."
        )
    name = "zero1" if is_zero_optimizer(optimizer) else wrapped_strategy(model).name
    problem = local_sgd_with_sharding(name, sync_every)
    if problem:
        raise ConfigError(f"{problem}.")
    if not isinstance(model, DistributedDataParallel):
        raise ConfigError(
            f"local SGD needs a DistributedDataParallel model: got {type(model).__name__}. "
            "Wrap it with ddpkit.wrap_model(model, runtime, strategy='ddp') first."
        )
    if getattr(model, "static_graph", False):
        raise ConfigError(f"{local_sgd_with_static_graph(sync_every)}.")
    if getattr(model, "_comm_hooks", None):  # DDP keeps its registered hooks there
        raise ConfigError(f"{local_sgd_with_comm_hook(sync_every, 'a comm hook')}.")
    stats = comm_stats if comm_stats is not None else CommStats()
    averager = PeriodicAverager(sync_every, runtime.process_group, stats)
    # entered here and never left while the averager lives: gradient sync is off for good
    averager.sync_off.enter_context(model.no_sync())
    mark_gradients_local(model)
    # imported here: torch.distributed.optim scripts its functional optimizers on import
    # (about 4 s of CPU), which every other ddpkit user would pay
    from torch.distributed.optim import PostLocalSGDOptimizer

    return PostLocalSGDOptimizer(optim=optimizer, averager=averager)
