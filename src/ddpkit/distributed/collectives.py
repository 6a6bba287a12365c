"""Thin wrappers over torch.distributed collectives that also work at world size 1."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ddpkit.distributed.process_group import Runtime


def all_reduce_sum(values: Sequence[float] | torch.Tensor, runtime: Runtime) -> torch.Tensor:
    """Sum ``values`` element-wise over all ranks.

    Collective: call on every rank with the same number of values. At world size 1 it returns
    the values unchanged (as a float64 tensor on CPU).

    Args:
        values: shape ``(k,)``; counts and sums to add up across ranks.
        runtime: the job's :class:`Runtime`.

    Returns:
        Shape ``(k,)``, dtype float64, on CPU: the global sums, identical on every rank.

    Example:
        >>> correct, count = all_reduce_sum([3, 5], runtime).tolist()   # doctest: +SKIP
    """
    tensor = torch.as_tensor(values, dtype=torch.float64).detach().clone().reshape(-1)
    if runtime.process_group is None:
        return tensor
    # nccl reduces only device tensors; gloo reduces CPU tensors.
    tensor = tensor.to(runtime.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=runtime.process_group)
    return tensor.cpu()


def barrier(runtime: Runtime) -> None:
    """Wait until every rank reaches this call. Collective. A no-op at world size 1."""
    if runtime.process_group is not None:
        dist.barrier(group=runtime.process_group)
