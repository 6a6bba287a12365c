"""The model and the gradient all-reduce of a live fault-tolerant job.

No ``DistributedDataParallel`` here: DDP binds its process group (and its reducer's state) when
it is built, and a member's death inside its backward leaves that reducer broken (torchft's DDP
wrapper crashed the *survivor* on 5 of 5 SIGKILLs of its peer, issue #22). The model stays a
plain module; :class:`~ddpkit.TrainStep` runs forward and backward locally, then all-reduces the
gradients in buckets on the current quorum's group (torch's ``all_reduce``, averaged over the
members as DDP averages them) inside one guarded operation, and steps the optimizer only once
every member agreed the step completed (:mod:`ddpkit.live.membership`). The price: no overlap of
the all-reduce with backward (measured in ``bench/live_trials.py``).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.errors import ConfigError
from ddpkit.runtime.collectives import broadcast_from_rank_zero

BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket_cap_mb=25
_STEPPING: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models inside a TrainStep now


class LiveModelError(ConfigError):
    """A live-mode model trained outside :class:`~ddpkit.TrainStep` (its gradients would not
    be all-reduced)."""


def prepare_live_model(
    module: nn.Module, device: torch.device, group: dist.ProcessGroup | None
) -> nn.Module:
    """The module on ``device``, its parameters and buffers broadcast from rank 0 (as DDP does
    when it is built), and a guard refusing a training forward outside ``TrainStep``.

    Collective over ``group`` (none when it is ``None``: a member alone, or a replacement not
    yet healed, whose state comes from a live peer).
    """
    module = module.to(device)
    if group is not None:
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor.data, group=group, group_src=0)
    module.register_forward_pre_hook(_refuse_outside_step)
    return module


def _refuse_outside_step(module: nn.Module, args: object) -> None:
    if module.training and torch.is_grad_enabled() and module not in _STEPPING:
        raise LiveModelError(
            "live fault tolerance: this model's gradients are all-reduced by ddpkit.TrainStep, "
            "not by a DDP wrapper (one that a dying peer would break). Train it through "
            "TrainStep/train_epoch (docs/fault-tolerance.md), or evaluate under torch.no_grad() "
            "(ddpkit.evaluate does)."
        )


class stepping:
    """``with stepping(model):`` marks ``model`` as inside a TrainStep (forwards allowed)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __enter__(self) -> None:
        _STEPPING.add(self.model)

    def __exit__(self, *exc: object) -> None:
        _STEPPING.discard(self.model)


def all_reduce_gradients(
    model: nn.Module, group: dist.ProcessGroup | None, world_size: int
) -> None:
    """Average the gradients of ``model``'s trainable parameters over the group's members, then
    give every member rank 0's buffers (:func:`broadcast_buffers`).

    Buckets of up to 25 MiB (DDP's default), each one ``all_reduce`` (SUM) launched
    asynchronously, then divided by ``world_size`` (DDP's average). A parameter without a
    gradient on this member counts as zeros, so every member reduces the same buckets.
    Collective over ``group``; a no-op when it is ``None`` (one member).
    """
    if group is None:
        return
    grads = []
    for param in [p for p in model.parameters() if p.requires_grad]:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grads.append(param.grad)
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for grad in grads:
        nbytes = grad.numel() * grad.element_size()
        if buckets[-1] and size + nbytes > BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(grad)
        size += nbytes
    flats = [torch.cat([g.reshape(-1) for g in bucket]) for bucket in buckets if bucket]
    works = [dist.all_reduce(flat, group=group, async_op=True) for flat in flats]
    for work in works:
        work.wait()
    with torch.no_grad():
        for bucket, flat in zip([b for b in buckets if b], flats, strict=True):
            flat.div_(world_size)
            for grad, part in zip(bucket, flat.split([g.numel() for g in bucket]), strict=True):
                grad.copy_(part.view_as(grad))
    broadcast_buffers(model, group)


def broadcast_buffers(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Give every member rank 0's buffers (BatchNorm running statistics): DDP broadcasts them
    before each forward (``broadcast_buffers=True``); here they are sent after the step's
    forwards, so every replica ends the step bitwise equal, buffers included. Collective over
    ``group``; nothing for a model without buffers."""
    broadcast_from_rank_zero(list(model.buffers()), group)
