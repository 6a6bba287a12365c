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

Under ``fsdp`` the parameters are shards, different on every rank by design: they are not
compared. The buffers are replicated (FSDP does not shard them, and does not broadcast them
either), so they are compared; BatchNorm statistics agree only with SyncBatchNorm.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpkit.errors import DistributedError
from ddpkit.log import get_logger
from ddpkit.runtime.process_group import Runtime
from ddpkit.wrappers import is_compiled, is_fsdp

_BLOCK = 4096  # words per row of the position-weighted sums


class ReplicaDivergenceError(DistributedError):
    """Replicas that should be identical differ (raised on every rank)."""


def tensor_digests(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Exact checksums of each tensor's bytes: ``(num_tensors, 3)`` int64 on CPU.

    The bytes are read as 32-bit words (bit patterns: NaN equals the same NaN, -0.0 differs
    from 0.0, any dtype). Row ``i`` holds, modulo 2**32, the words' sum and two position-weighted
    sums (the words laid out in rows of 4096: column sums weighted by column, row sums weighted
    by row), so a changed word or two swapped ones change the row. Integer sums do not depend on
    the summation order, so the same bytes give the same row on any device and in any kernel.
    Cost: two reductions over the data on its own device, no copy of it (on 2 CPU cores, ~1 ms
    for the 1.3 M values of the MNIST CNN and its Adam state); one transfer to CPU at the end.
    """
    words = [_words(t) for t in tensors]
    digests = torch.zeros(len(words), 3, dtype=torch.int64)
    small: dict[torch.device, list[int]] = {}
    for index, w in enumerate(words):
        if w.numel() >= _BLOCK:
            digests[index] = _digest_words(w).cpu().to(torch.int64)
        else:  # many tiny tensors (biases, optimizer step counters): digested together
            small.setdefault(w.device, []).append(index)
    for indices in small.values():
        digests[indices] = _digest_small([words[i] for i in indices]).cpu().to(torch.int64)
    return digests & 0xFFFFFFFF


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a 1-D int32 tensor (a view when the byte count allows)."""
    data = tensor.detach()
    if data.layout != torch.strided:
        data = data.to_dense()
    if data.is_complex():
        data = torch.view_as_real(data)
    raw = data.contiguous().reshape(-1).view(torch.uint8)
    if raw.numel() % 4 == 0:
        return raw.view(torch.int32)
    return raw.to(torch.int32)  # an odd byte count: one word per byte


def _digest_small(words: list[torch.Tensor]) -> torch.Tensor:
    """``(len(words), 3)`` int32: what :func:`_digest_words` gives each tensor of fewer than
    4096 words (one row: the row-weighted sum is the sum), in a few operations for all."""
    device = words[0].device
    lengths = torch.tensor([w.numel() for w in words], device=device)
    segment = torch.repeat_interleave(torch.arange(len(words), device=device), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    data = torch.cat(words)
    position = (torch.arange(data.numel(), device=device) - starts[segment] + 1).to(torch.int32)
    total = torch.zeros(len(words), dtype=torch.int32, device=device).index_add_(0, segment, data)
    weighted = torch.zeros_like(total).index_add_(0, segment, data * position)
    return torch.stack([total, weighted, total], dim=1)


def _digest_words(words: torch.Tensor) -> torch.Tensor:
    """``(3,)`` int32: sum, column-weighted and row-weighted sums (all wrapping mod 2**32)."""
    i32, device = torch.int32, words.device
    num_full = words.numel() // _BLOCK * _BLOCK
    block, tail = words[:num_full].view(-1, _BLOCK), words[num_full:]
    columns = (
        block.sum(dim=0, dtype=i32) if num_full else torch.zeros(_BLOCK, dtype=i32, device=device)
    )
    columns[: tail.numel()] += tail  # the tail is one more (short) row
    row_sums = torch.cat([block.sum(dim=1, dtype=i32), tail.sum(dtype=i32).reshape(1)])
    column_weight = torch.arange(1, _BLOCK + 1, dtype=i32, device=device)
    row_weight = torch.arange(1, row_sums.numel() + 1, dtype=i32, device=device)
    return torch.stack(
        [
            columns.sum(dtype=i32),
            (columns * column_weight).sum(dtype=i32),
            (row_sums * row_weight).sum(dtype=i32),
        ]
    )


def differing_from_rank_zero(
    tensors: Sequence[torch.Tensor], runtime: Runtime, *, op: str
) -> dict[int, list[int]]:
    """``{rank: indices of the tensors whose bytes differ from rank 0's}``, ranks 1.. in order
    (only those that differ). Exact (:func:`tensor_digests`), one all-gather of
    ``24 * len(tensors)`` bytes under the watchdog as ``op``.

    Collective: call on every rank with the same number of tensors. ``{}`` at world size 1.
    """
    if runtime.process_group is None:
        return {}
    local = tensor_digests(tensors).to(runtime.device)
    gathered = [torch.empty_like(local) for _ in range(runtime.world_size)]
    with runtime.watch(op):
        dist.all_gather(gathered, local, group=runtime.process_group)
    reference = gathered[0].cpu()
    differing = {}
    for rank, other in enumerate(gathered[1:], start=1):
        indices = (reference != other.cpu()).any(dim=1).nonzero().flatten().tolist()
        if indices:
            differing[rank] = indices
    return differing


def _ddp_layer(model: nn.Module) -> DistributedDataParallel | None:
    """The DDP wrapper of ``model`` (also under ``torch.compile``), or None."""
    while not isinstance(model, DistributedDataParallel):
        if not is_compiled(model):
            return None
        inner = model._orig_mod
        assert isinstance(inner, nn.Module)  # torch.compile wraps a module
        model = inner
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
    ignored: set[str] = getattr(layer, "parameters_to_ignore", set())
    return {id(b) for name, b in layer.module.named_buffers() if name not in ignored}


_TOLD_SHARDED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _sharded(model: nn.Module) -> bool:
    """True for an FSDP model, whose parameters are shards (different on every rank by
    design): said once per model in an info line, and only its buffers are compared."""
    if not is_fsdp(model):
        return False
    if model not in _TOLD_SHARDED:
        _TOLD_SHARDED.add(model)
        get_logger("guards").info(
            "check_replicas: strategy fsdp shards every parameter, so only the replicated "
            "state is compared: the %d buffer(s).",
            sum(1 for _ in model.buffers()),
        )
    return True


def buffer_fix(model: nn.Module) -> str:
    """How to make ``model``'s buffers agree across ranks, in one or two sentences."""
    if is_fsdp(model):
        return (
            "FSDP does not broadcast buffers: each rank keeps the statistics of its own shard, "
            "and only rank 0's are saved and evaluated. Use SyncBatchNorm for statistics over "
            "all ranks (ddpkit.wrap_model(..., strategy='fsdp', sync_batchnorm=True))."
        )
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


def check_replicas(model: nn.Module, runtime: Runtime, *, step: int) -> None:
    """Raise on every rank if any rank's parameters or unsynced buffers differ from rank 0's.

    Compares the exact checksums of :func:`tensor_digests` (three per tensor), gathered in
    one all-gather. Buffers DDP overwrites with rank 0's at the next forward (its default) are
    skipped: they differ between forwards by design (see the module docstring). Cost: one pass
    over the parameters on their device and an all-gather of ``24 * num_tensors`` bytes.
    An ``fsdp`` model's parameters are shards: only its buffers are compared (an info line
    says so once; without buffers nothing is compared and nothing communicated).

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
        ...     check_replicas(model, rt, step=step)  # raises on every rank if they differ
    """
    if runtime.process_group is None:
        return
    skipped = synced_buffers(model)
    params = [] if _sharded(model) else list(model.named_parameters())
    buffers = [(n, b) for n, b in model.named_buffers() if id(b) not in skipped]
    if not params and not buffers:  # fsdp without buffers: nothing replicated (same everywhere)
        return
    names = [n for n, _ in params + buffers]
    num_params = len(params)
    param_problems, buffer_problems = [], []
    differing = differing_from_rank_zero(
        [t for _, t in params + buffers], runtime, op="replica check all_gather"
    )
    for rank, indices in differing.items():
        bad_params = [names[i] for i in indices if i < num_params]
        bad_buffers = [names[i] for i in indices if i >= num_params]
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
