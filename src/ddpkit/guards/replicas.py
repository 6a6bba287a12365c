"""Replica checks: exact checksums of parameters and buffers, compared across ranks.

What DDP keeps identical, and what it does not:

- **parameters**: bitwise identical on every rank after every step (same start, same averaged
  gradients, same optimizer). Any difference is a bug (a rank-dependent update, a skipped
  all-reduce, a parameter changed on one rank).
- **buffers** (BatchNorm ``running_mean``/``running_var``/``num_batches_tracked``): with DDP's
  default buffer broadcast, the forward *begins* by copying rank 0's buffers into every rank,
  and BatchNorm then updates them *in the same forward* with that rank's own batch. So between
  two forwards (where a step ends, where checks and saves run) each rank holds
  ``(1 - momentum) * rank 0's + momentum * its own batch statistic``: they differ by design,
  and the next forward overwrites them with rank 0's again. Rank 0's buffers are the model's
  (what is saved, evaluated, and what every rank continues from), so such buffers are not
  compared. With ``broadcast_buffers=False`` (``forward_sync_buffers=False``) nothing
  overwrites them: each rank keeps statistics of its own shard for good; those are compared.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpkit.distributed.process_group import Runtime
from ddpkit.errors import DistributedError
from ddpkit.parallel.wrap import is_compiled

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReplicaDivergenceError(DistributedError):
    """Replicas that should be identical differ (raised on every rank)."""


def tensor_digests(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Exact checksums of each tensor's bytes: ``(num_tensors, 2)`` int64 on CPU.

    Each tensor's elements are read as integers of the same width (bit patterns, so NaN equals
    the same NaN and -0.0 differs from 0.0); row ``i`` holds their sum and their sum weighted by
    position (1, 2, ...), both modulo 2**64. Integer sums do not depend on the summation order,
    so the same bytes give the same row on any device and in any kernel; a changed element or two
    swapped ones change the row. Computed on each tensor's own device, one copy to CPU at the end.
    """
    if not tensors:
        return torch.zeros(0, 2, dtype=torch.int64)
    rows = []
    for tensor in tensors:
        data = tensor.detach()
        if data.layout != torch.strided:
            data = data.to_dense()
        if data.is_complex():
            data = torch.view_as_real(data)
        flat = data.contiguous().reshape(-1)
        words = flat.view(_INT_OF_SIZE[flat.element_size()]).to(torch.int64)
        weights = torch.arange(1, words.numel() + 1, dtype=torch.int64, device=words.device)
        rows.append(torch.stack([words.sum(), (words * weights).sum()]))
    return torch.stack([row.cpu() for row in rows])


def _ddp_layer(model: nn.Module) -> DistributedDataParallel | None:
    """The DDP wrapper of ``model`` (also under ``torch.compile``), or None."""
    while not isinstance(model, DistributedDataParallel):
        if not is_compiled(model):
            return None
        model = model._orig_mod
    return model


def synced_buffers(model: nn.Module) -> set[int]:
    """``id()`` of each buffer DDP overwrites with rank 0's at the start of every forward.

    All buffers of a DDP model (also inside ``torch.compile``) unless it was built with
    ``broadcast_buffers=False``/``forward_sync_buffers=False`` or told to ignore them; none for
    a model without DDP.
    """
    layer = _ddp_layer(model)
    if layer is None:
        return set()
    # torch 2.13 calls the switch forward_sync_buffers; broadcast_buffers (its old name) remains
    if not getattr(layer, "forward_sync_buffers", getattr(layer, "broadcast_buffers", True)):
        return set()
    ignored = getattr(layer, "parameters_to_ignore", set())
    return {id(b) for name, b in layer.module.named_buffers() if name not in ignored}


def buffer_fix(model: nn.Module) -> str:
    """How to make ``model``'s buffers agree across ranks, in one or two sentences."""
    if _ddp_layer(model) is not None:
        return (
            "DDP was built with broadcast_buffers=False (forward_sync_buffers=False), so each "
            "rank keeps the statistics of its own shard and only rank 0's are saved and "
            "evaluated. Use SyncBatchNorm for statistics over all ranks "
            "(ddpkit.wrap_model(..., sync_batchnorm=True)), or keep DDP's default buffer "
            "broadcast."
        )
    return (
        "Something changed one replica's buffers (a rank-dependent update, a skipped "
        "broadcast). Wrap the model with ddpkit.wrap_model so DDP broadcasts rank 0's buffers, "
        "or use SyncBatchNorm (sync_batchnorm=True)."
    )


def check_replicas(model: nn.Module, runtime: Runtime, step: int) -> None:
    """Raise on every rank if any rank's parameters or unsynced buffers differ from rank 0's.

    Compares the exact checksums of :func:`tensor_digests` (two int64 per tensor), gathered in
    one all-gather. Buffers DDP overwrites with rank 0's at the next forward (its default) are
    skipped: they differ between forwards by design (see the module docstring). Cost: one pass
    over the parameters on their device and an all-gather of ``16 * num_tensors`` bytes.

    Collective: call on every rank at the same step. A no-op at world size 1.

    Args:
        model: the wrapped (or plain) model; names in the message are its ``named_parameters``.
        runtime: the job's :class:`~ddpkit.Runtime`.
        step: reported in the message.

    Raises:
        ReplicaDivergenceError: ``replicas diverged at step N: rank r differs in <parameters>``
            (a bug: something changed one replica outside DDP), or ``... differs in buffers
            <names>`` with the fix (SyncBatchNorm, or DDP's buffer broadcast).

    Example:
        >>> if step % 100 == 0:
        ...     check_replicas(model, rt, step)                     # doctest: +SKIP
    """
    if runtime.process_group is None:
        return
    skipped = synced_buffers(model)
    params = list(model.named_parameters())
    buffers = [(n, b) for n, b in model.named_buffers() if id(b) not in skipped]
    names = [n for n, _ in params + buffers]
    local = tensor_digests([t for _, t in params + buffers]).to(runtime.device)
    gathered = [torch.empty_like(local) for _ in range(runtime.world_size)]
    with runtime.watch("replica check all_gather"):
        dist.all_gather(gathered, local, group=runtime.process_group)
    reference = gathered[0].cpu()
    num_params = len(params)
    param_problems, buffer_problems = [], []
    for rank, other in enumerate(gathered[1:], start=1):
        differs = (reference != other.cpu()).any(dim=1).tolist()
        bad_params = [n for i, n in enumerate(names[:num_params]) if differs[i]]
        bad_buffers = [n for i, n in enumerate(names[num_params:]) if differs[num_params + i]]
        if bad_params:
            param_problems.append(f"rank {rank} differs in {', '.join(bad_params)}")
        if bad_buffers:
            buffer_problems.append(f"rank {rank} differs in buffers {', '.join(bad_buffers)}")
    if param_problems:
        raise ReplicaDivergenceError(
            f"replicas diverged at step {step}: {'; '.join(param_problems + buffer_problems)} "
            "(compared with rank 0). Something changed one replica outside DDP (a "
            "rank-dependent update, a skipped all-reduce, a broadcast missed)."
        )
    if buffer_problems:
        raise ReplicaDivergenceError(
            f"replicas diverged at step {step}: {'; '.join(buffer_problems)} (compared with "
            f"rank 0). {buffer_fix(model)}"
        )
