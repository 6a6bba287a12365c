"""Thin wrappers over torch.distributed collectives that also work at world size 1.

Debug switch: with ``DDPKIT_DEBUG_COLLECTIVES=1`` in the environment (or
``runtime.debug_collectives = True``), every ddpkit collective first compares the shape and dtype
of its tensor across ranks and raises on every rank, naming each rank's shape, instead of
hanging, aborting or returning garbage (gloo happily all-reduces a (2, 4) tensor with a (4, 2)
one). It costs one extra small all-reduce per collective, so it is off by default. The check is
itself an all-reduce, so it never turns a fast failure into a hang: a rank whose peer runs a
different all-reduce still gets gloo's immediate abort.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ddpkit.errors import DistributedError
from ddpkit.runtime.process_group import Runtime

_F = TypeVar("_F", bound=Callable[..., Any])

DEBUG_ENV = "DDPKIT_DEBUG_COLLECTIVES"
_MAX_DIMS = 8
_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]


def _describe(row: list[int]) -> str:
    code, dims = row[1], row[2 : 2 + row[0]]
    dtype = str(_DTYPES[code]).replace("torch.", "") if 0 <= code < len(_DTYPES) else "other"
    return f"{dtype} {tuple(dims)}"


def verify_same_shape(tensor: torch.Tensor, runtime: Runtime, op: str) -> None:
    """Raise on every rank unless all ranks pass a tensor of the same shape and dtype.

    Collective: call on every rank before the collective it guards. A no-op at world size 1.

    Raises:
        DistributedError: ``all_reduce: tensors differ across ranks: rank 0 float32 (4,), rank 1
            float32 (8,)``; also for tensors of more than 8 dimensions.
    """
    if runtime.process_group is None:
        return
    if tensor.dim() > _MAX_DIMS:
        raise DistributedError(f"{op}: the shape check supports up to {_MAX_DIMS} dims.")
    code = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else len(_DTYPES)
    row = [tensor.dim(), code, *tensor.shape] + [-1] * (_MAX_DIMS - tensor.dim())
    # An all-reduce of a table where each rank fills its own row, not an all-gather: the check
    # is then the same operation as the collective it guards, so a rank that meets a different
    # all-reduce (a raw one, DDP's buckets) fails as fast as without the check (gloo aborts on
    # the size mismatch) instead of an all-gather waiting forever for a partner.
    table = torch.zeros(runtime.world_size, len(row), dtype=torch.int64, device=runtime.device)
    table[runtime.rank] = torch.tensor(row, dtype=torch.int64)
    with runtime.watch(f"{op} shape check"):
        dist.all_reduce(table, group=runtime.process_group)
    described = [_describe(r.tolist()) for r in table.cpu()]
    if len(set(described)) > 1:
        listing = ", ".join(f"rank {r} {d}" for r, d in enumerate(described))
        raise DistributedError(
            f"{op}: tensors differ across ranks: {listing}. Every rank must pass a tensor of the "
            "same shape and dtype to a collective."
        )


def live_guarded(op: str) -> Callable[[_F], _F]:
    """Live fault tolerance: run the collective as a guarded operation (see
    :meth:`ddpkit.live.membership.LiveMembership.run`): a member lost during it moves every
    member to the next quorum, where it runs again over the members that remain (a sum then
    adds up their values only). Inside a larger guarded operation it just runs."""

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            runtime = kwargs.get("runtime") or next(a for a in args if isinstance(a, Runtime))
            live = getattr(runtime, "live", None)
            if live is None or live.quorum is None:
                return fn(*args, **kwargs)
            return live.run(op, lambda: fn(*args, **kwargs))

        return guarded  # type: ignore[return-value]

    return decorate


def broadcast_from_rank_zero(
    tensors: Sequence[torch.Tensor], group: Any, *, device: torch.device | None = None
) -> None:
    """Copy rank 0's values into ``tensors`` on every rank of ``group``, in place: the tensors
    flattened together, one ``broadcast`` per dtype (how DDP broadcasts a module's buffers).
    ``device``: where the flat copy travels (the backend's device; default: the tensors').

    Collective over ``group``: every rank passes tensors of the same shapes and dtypes, in the
    same order. Empty tensors are skipped; nothing is sent when none is left.
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        if tensor.numel():
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
    with torch.no_grad():
        for same in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in same])
            flat = flat.to(device) if device is not None else flat
            dist.broadcast(flat, group=group, group_src=0)
            for tensor, part in zip(same, flat.split([t.numel() for t in same]), strict=True):
                tensor.copy_(part.view_as(tensor))


def _debug_enabled(runtime: Runtime) -> bool:
    return runtime.debug_collectives or os.environ.get(DEBUG_ENV, "") not in ("", "0")


@live_guarded("all_reduce")
def all_reduce(
    tensor: torch.Tensor, runtime: Runtime, *, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks with ``op``; returns a new tensor (input untouched).

    Collective: call on every rank with tensors of equal shape and dtype (checked under the
    debug switch). At world size 1 it returns a copy.

    Returns:
        Same shape and dtype as ``tensor``, on ``tensor``'s device: the reduction, identical on
        every rank.

    Raises:
        DistributedError: the runtime was closed (also from every collective built on this one).
    """
    runtime.check_open("all_reduce")
    result = tensor.detach().clone()
    if runtime.process_group is None:
        return result
    if _debug_enabled(runtime):
        verify_same_shape(result, runtime, "all_reduce")
    work = result.to(runtime.device)  # nccl reduces device tensors; gloo CPU ones
    with runtime.watch("all_reduce"):
        dist.all_reduce(work, op=op, group=runtime.process_group)
    return work.to(tensor.device)


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
        >>> correct, count = all_reduce_sum([3, 5], runtime).tolist()
        >>> correct, count                                  # 2 ranks, each with 3 of 5 right
        (6.0, 10.0)
    """
    tensor = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
    return all_reduce(tensor.cpu(), runtime)


@live_guarded("gather_per_rank")
def gather_per_rank(values: Sequence[float], runtime: Runtime) -> torch.Tensor:
    """Every rank's ``values``, row by rank: how ranks compare counters, flags and scales.

    Collective: call on every rank with the same number of values (one all-reduce of
    ``world_size * k`` floats; each rank fills its own row). At world size 1 it returns the
    values as one row.

    Args:
        values: shape ``(k,)``; this rank's numbers.
        runtime: the job's :class:`Runtime`.

    Returns:
        Shape ``(world_size, k)``, dtype float64, on CPU; row ``r`` holds rank ``r``'s values.

    Example:
        >>> gather_per_rank([10 * runtime.rank, 1], runtime)   # 2 ranks
        tensor([[ 0.,  1.],
                [10.,  1.]], dtype=torch.float64)
    """
    row = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
    table = torch.zeros(runtime.world_size, row.numel(), dtype=torch.float64)
    table[runtime.rank] = row
    return all_reduce(table, runtime)


@live_guarded("barrier")
def barrier(runtime: Runtime) -> None:
    """Wait until every rank reaches this call. Collective. A no-op at world size 1.

    Raises:
        DistributedError: the runtime was closed.
    """
    runtime.check_open("barrier")
    if runtime.process_group is not None:
        with runtime.watch("barrier"):
            dist.barrier(group=runtime.process_group)


@live_guarded("all_gather_object")
def all_gather_object(obj: Any, runtime: Runtime) -> list[Any]:
    """Every rank's ``obj`` (any picklable object of any size), as a list by rank.

    torch's ``all_gather_object`` on the job's process group (pickles, so meant for small,
    occasional payloads: metric inputs, settings, names). With nccl, objects travel through the
    current CUDA device, which :func:`~ddpkit.init_runtime` sets.

    Collective: call on every rank. At world size 1 it returns ``[obj]``.

    Returns:
        ``[rank 0's obj, rank 1's obj, ...]``, the same on every rank (unpickled copies).

    Raises:
        DistributedError: the runtime was closed.

    Example:
        >>> ddpkit.all_gather_object({"rank": rt.rank}, rt)   # 2 ranks
        [{'rank': 0}, {'rank': 1}]
    """
    runtime.check_open("all_gather_object")
    if runtime.process_group is None:
        return [obj]
    gathered: list[Any] = [None] * runtime.world_size
    with runtime.watch("all_gather_object"):
        dist.all_gather_object(gathered, obj, group=runtime.process_group)
    return gathered


@live_guarded("all_gather")
def all_gather(tensor: torch.Tensor, runtime: Runtime) -> list[torch.Tensor]:
    """Every rank's ``tensor``, as a list by rank; the first dimension may differ across ranks.

    What metrics need from each rank's predictions (one batch count per rank): the sizes are
    gathered first, each tensor padded to the largest, gathered with torch's ``all_gather``, and
    trimmed back. ``torch.cat(ddpkit.all_gather(preds, rt))`` is every rank's rows, rank 0's
    first. Over :func:`~ddpkit.build_eval_loader`'s shards (contiguous blocks in rank order) that
    is dataset order, so the predictions line up with the dataset's labels; over a training
    loader's shards (shuffled, padded) or a stream's (rank x worker slots) it is not.

    Collective: call on every rank, with tensors of the same dtype and the same trailing
    dimensions ``(n_r, *rest)`` (``n_r`` may be 0); two all-gathers. At world size 1 it returns
    ``[a copy of tensor]``.

    Args:
        tensor: shape ``(n_r, *rest)``, or a scalar (0 dims) on every rank; at most 8 dims.
        runtime: the job's :class:`~ddpkit.Runtime`.

    Returns:
        ``world_size`` tensors on ``tensor``'s device, row ``r`` of shape ``(n_r, *rest)``.

    Raises:
        TypeError: ``tensor`` is not a ``torch.Tensor`` (before any communication).
        DistributedError (on every rank): dtypes or trailing dimensions differ across ranks,
            naming each rank's dtype and shape; or more than 8 dims; the runtime was closed.

    Example:
        >>> preds = torch.cat(ddpkit.all_gather(model(x).argmax(1), rt))  # every rank's rows
        >>> preds.shape == (rt.world_size * len(x),)
        True
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"all_gather: tensor is a {type(tensor).__name__}: it gathers torch.Tensors. Pass "
            "torch.as_tensor(value), or gather any picklable object with "
            "ddpkit.all_gather_object(value, runtime)."
        )
    runtime.check_open("all_gather")
    if runtime.process_group is None:
        return [tensor.detach().clone()]
    work = tensor.detach().to(runtime.device)
    if work.dim() > _MAX_DIMS:
        raise DistributedError(f"all_gather: the size exchange supports up to {_MAX_DIMS} dims.")
    code = _DTYPES.index(work.dtype) if work.dtype in _DTYPES else len(_DTYPES)
    row = [work.dim(), code, *work.shape] + [-1] * (_MAX_DIMS - work.dim())
    local = torch.tensor(row, dtype=torch.int64, device=runtime.device)
    rows = [torch.empty_like(local) for _ in range(runtime.world_size)]
    with runtime.watch("all_gather sizes"):
        dist.all_gather(rows, local, group=runtime.process_group)
    table = [r.tolist() for r in rows]
    if len({(r[0], r[1], *r[3:]) for r in table}) > 1:
        listing = ", ".join(f"rank {r} {_describe(t)}" for r, t in enumerate(table))
        raise DistributedError(
            f"all_gather: tensors differ across ranks beyond the first dimension: {listing}. "
            "Every rank must pass the same dtype and trailing dimensions (only dim 0 may "
            "differ); convert or reshape before gathering."
        )
    scalar = work.dim() == 0
    sizes = [1 if scalar else r[2] for r in table]
    gathered = _gather_padded(work.reshape(1) if scalar else work, sizes, runtime, tensor.device)
    return [g.reshape(()) for g in gathered] if scalar else gathered


def _gather_padded(
    work: torch.Tensor, sizes: list[int], runtime: Runtime, device: torch.device
) -> list[torch.Tensor]:
    longest = max(sizes)
    if longest == 0:  # nothing to send: empty tensors of the right shape
        return [work.new_empty((0, *work.shape[1:]), device=device) for _ in sizes]
    padded = work.new_zeros((longest, *work.shape[1:]))
    padded[: work.shape[0]] = work
    gathered = [torch.empty_like(padded) for _ in sizes]
    with runtime.watch("all_gather"):
        dist.all_gather(gathered, padded, group=runtime.process_group)
    return [g[:n].to(device) for g, n in zip(gathered, sizes, strict=True)]
