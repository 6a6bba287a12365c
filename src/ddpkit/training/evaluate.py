"""Exact distributed evaluation: global sums divided by global counts, each sample counted once,
scored by the model that is saved (rank 0's buffers)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn
from torch.nn import functional as F

from ddpkit.parallel.fsdp import gathered_for_eval
from ddpkit.parallel.wrap import unwrap_model
from ddpkit.runtime.collectives import all_reduce_sum, broadcast_from_rank_zero
from ddpkit.runtime.process_group import Runtime


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: Iterable[tuple[torch.Tensor, torch.Tensor]],
    runtime: Runtime,
    *,
    loss_fn: Callable[..., torch.Tensor] = F.cross_entropy,
) -> dict[str, float]:
    """Classification loss and accuracy over the whole evaluation set.

    The model scored is the one that is saved: rank 0's. Parameters are identical on every rank
    under DDP, but buffers (BatchNorm running statistics) are not: each training forward updates
    them with that rank's own batch after DDP copied rank 0's in, and with
    ``broadcast_buffers=False`` they stay per rank for good. So rank 0's buffers are broadcast
    first (what DDP's next forward would do), every rank scores its shard with them, and each
    rank's own buffers are put back afterwards: evaluation never changes training. Cost: one
    broadcast per buffer dtype (none for a model without buffers), and a copy of the buffers.

    Each rank runs the *unwrapped* model on its own shard (build the loader with
    :func:`ddpkit.build_eval_loader`, which gives every sample to exactly one rank), so shards
    of unequal length never wait on DDP's per-forward collectives. An ``fsdp`` model gathers
    all its parameters once before the pass and reshards after it (one all-gather per FSDP
    unit; the whole model is on every rank meanwhile), so its forwards need no collective
    either. Then one all-reduce adds up
    ``(loss_sum, num_correct, num_samples)``: accuracy = global correct / global count, never a
    mean of per-rank means.

    Collective: call on every rank. At world size 1: the model's own buffers, no communication.

    Args:
        model: wrapped or plain; logits of shape ``(batch, num_classes)``.
        loader: yields ``(inputs, targets)`` with targets of shape ``(batch,)``.
        runtime: the job's :class:`Runtime`.
        loss_fn: a loss taking ``reduction="sum"``.

    Returns:
        ``{"loss": mean loss per sample, "accuracy": 0..1, "num_samples": global count}``;
        the same on every rank. With zero samples, loss and accuracy are NaN.

    Example:
        >>> test = build_eval_loader(test_set, rt, batch_size=1000)
        >>> metrics = evaluate(model, test, rt)  # the same on every rank
        >>> sorted(metrics)
        ['accuracy', 'loss', 'num_samples']
        >>> metrics["num_samples"]  # each of the 20 test samples counted once
        20
    """
    if runtime.live is not None and runtime.live.quorum is not None:
        # a member lost mid-way: the whole pass again over the members that remain
        return runtime.live.run("evaluation", lambda: _evaluate(model, loader, runtime, loss_fn))
    return _evaluate(model, loader, runtime, loss_fn)


def _evaluate(
    model: nn.Module,
    loader: Iterable[tuple[torch.Tensor, torch.Tensor]],
    runtime: Runtime,
    loss_fn: Callable[..., torch.Tensor],
) -> dict[str, float]:
    module = unwrap_model(model)
    was_training = module.training
    loss_sum = num_correct = num_samples = 0.0
    with gathered_for_eval(module), rank_zero_buffers(module, runtime):
        module.eval()
        try:
            for inputs, targets in loader:
                inputs, targets = inputs.to(runtime.device), targets.to(runtime.device)
                logits = module(inputs)
                loss_sum += float(loss_fn(logits, targets, reduction="sum"))
                num_correct += float((logits.argmax(dim=1) == targets).sum())
                num_samples += targets.numel()
        finally:
            module.train(was_training)
    loss_sum, num_correct, num_samples = all_reduce_sum(
        [loss_sum, num_correct, num_samples], runtime
    ).tolist()
    if num_samples == 0:
        return {"loss": float("nan"), "accuracy": float("nan"), "num_samples": 0}
    return {
        "loss": loss_sum / num_samples,
        "accuracy": num_correct / num_samples,
        "num_samples": int(num_samples),
    }


@contextlib.contextmanager
def rank_zero_buffers(module: nn.Module, runtime: Runtime) -> Iterator[None]:
    """Give every rank rank 0's buffers inside the block; put each rank's own back afterwards.

    Collective: call on every rank with the same module structure. One broadcast per buffer
    dtype over the runtime's process group (as DDP's forward does, from rank 0); a no-op at world
    size 1 or for a module without buffers.
    """
    buffers = [b for b in module.buffers() if b.numel()]
    if runtime.process_group is None or not buffers:
        yield
        return
    own = [b.detach().clone() for b in buffers] if not runtime.is_rank_zero else []
    with runtime.watch("evaluate: broadcast rank 0's buffers"):
        broadcast_from_rank_zero(buffers, runtime.process_group, device=runtime.device)
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, saved in zip(buffers, own, strict=False):
                buffer.copy_(saved)
