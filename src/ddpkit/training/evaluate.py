"""Exact distributed evaluation: global sums divided by global counts, each sample counted once."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.nn import functional as F

from ddpkit.distributed.collectives import all_reduce_sum
from ddpkit.distributed.process_group import Runtime
from ddpkit.parallel.wrap import unwrap_model


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: Iterable[tuple[torch.Tensor, torch.Tensor]],
    runtime: Runtime,
    loss_fn: Callable[..., torch.Tensor] = F.cross_entropy,
) -> dict[str, float]:
    """Classification loss and accuracy over the whole evaluation set.

    Each rank runs the *unwrapped* model on its own shard (build the loader with
    :func:`ddpkit.build_eval_loader`, which gives every sample to exactly one rank), so shards
    of unequal length never wait on DDP's per-forward collectives. Then one all-reduce adds up
    ``(loss_sum, num_correct, num_samples)``: accuracy = global correct / global count, never a
    mean of per-rank means.

    Collective: call on every rank.

    Args:
        model: wrapped or plain; logits of shape ``(batch, num_classes)``.
        loader: yields ``(inputs, targets)`` with targets of shape ``(batch,)``.
        runtime: the job's :class:`Runtime`.
        loss_fn: a loss taking ``reduction="sum"``.

    Returns:
        ``{"loss": mean loss per sample, "accuracy": 0..1, "num_samples": global count}``;
        the same on every rank. With zero samples, loss and accuracy are NaN.
    """
    module = unwrap_model(model)
    was_training = module.training
    module.eval()
    loss_sum = num_correct = num_samples = 0.0
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
