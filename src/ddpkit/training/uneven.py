"""Uneven inputs: ranks with different numbers of batches either agree first or use ``Join``.

A DDP rank that runs out of batches stops calling forward/backward while its peers wait in
gradient all-reduces it will never join: a hang until the collective timeout. Two remedies:

- :func:`verify_even_batches` (the default path; :class:`~ddpkit.ShardedLoader` is even by
  construction): one all-reduce of every rank's batch count before the pass; uneven counts raise
  on every rank at once, naming each rank's count, instead of hanging.
- :func:`join_uneven_inputs`: torch's ``torch.distributed.algorithms.Join`` with the DDP model
  as joinable, for inputs that cannot be made even. A rank that has run out "joins": until the
  last rank finishes, it shadows the others' DDP all-reduces with zero gradients; the DDP model
  then broadcasts the final parameters from the last rank to join, so replicas end equal.
  Semantics: gradients are still divided by the *full* world size (DDP's default), so on a step
  where only some ranks have data, each contributing rank's gradient weighs 1/world_size. Only
  DDP's own collectives are shadowed: inside the context no rank may call another collective
  per step (ddpkit's non-finite guard, replica check, checkpoint saves, ``16-mixed``'s
  overflow agreement in :meth:`~ddpkit.MixedPrecision.step`, the accumulation count all-reduce
  of non-:class:`~ddpkit.ShardedLoader` inputs) — the joined rank would not answer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.distributed.algorithms import Join
from torch.nn.parallel import DistributedDataParallel

from ddpkit.errors import ConfigError, DistributedError
from ddpkit.guards.grad_sync import gradients_local  # marked by enable_local_sgd
from ddpkit.monitoring.stragglers import paused
from ddpkit.runtime.collectives import gather_per_rank
from ddpkit.runtime.process_group import Runtime
from ddpkit.training.rules import join_with_local_sgd


class UnevenInputsError(DistributedError):
    """Ranks have different numbers of batches (raised on every rank)."""


def verify_even_batches(num_batches: int, runtime: Runtime) -> None:
    """Raise on every rank unless every rank has ``num_batches`` equal to the others'.

    Collective: call on every rank before the pass (one all-reduce of ``world_size`` numbers).
    A no-op at world size 1.

    Args:
        num_batches: batches this rank will run in the coming pass.
        runtime: the job's :class:`~ddpkit.Runtime`.

    Raises:
        UnevenInputsError: ``uneven inputs: rank 0 has 5 batches, rank 1 has 4 ...``.

    Example:
        >>> verify_even_batches(len(loader), rt)  # silent: 4 batches on each rank
        >>> verify_even_batches(4 + rt.rank, rt)
        Traceback (most recent call last):
        ddpkit.training.uneven.UnevenInputsError: uneven inputs: rank 0 has 4 batches, rank 1 ...
    """
    if runtime.world_size == 1:
        return
    counts = [int(c) for c in gather_per_rank([num_batches], runtime)[:, 0].tolist()]
    if len(set(counts)) > 1:
        listing = ", ".join(f"rank {r} has {c} batches" for r, c in enumerate(counts))
        raise UnevenInputsError(
            f"uneven inputs: {listing}. DDP would hang at the first step one rank does not "
            "take. Make the loader even (ddpkit.build_train_loader pads every shard to the same "
            "length), or train inside ddpkit.training.uneven.join_uneven_inputs(model, runtime) "
            "(ddpkit train --join)."
        )


def join_uneven_inputs(
    model: nn.Module, runtime: Runtime, *, enable: bool = True
) -> contextlib.AbstractContextManager:
    """A context in which ranks may run different numbers of DDP iterations without hanging.

    torch's ``Join([model])``; errors are raised as usual (``throw_on_early_termination`` is
    off: ranks that finish early shadow the rest). See the module docstring for the semantics.

    Collective: enter and leave on every rank. At world size 1 (no DDP) it is a plain context.
    No other collective may run per step inside: the straggler detector's exchange is paused
    (:func:`ddpkit.monitoring.stragglers.paused`).

    Args:
        model: the DDP-wrapped model.
        runtime: the job's :class:`~ddpkit.Runtime`.
        enable: ``False`` gives a context that does nothing (to switch it by a flag).

    Raises:
        ConfigError: world size above 1 and ``model`` is not ``DistributedDataParallel``, or
            :func:`~ddpkit.enable_local_sgd` turned its gradient sync off (Join does not shadow
            the averaging all-reduce, so a rank that ran out of data would leave the others
            waiting).

    Example:
        >>> uneven_batches = [(x, y)] * (2 + rt.rank)  # rank 1 has one batch more
        >>> with join_uneven_inputs(ddp_model, rt):
        ...     for x, y in uneven_batches:
        ...         F.cross_entropy(ddp_model(x), y).backward()
    """
    if not enable or runtime.world_size == 1:
        return contextlib.nullcontext()
    if not isinstance(model, DistributedDataParallel):
        raise ConfigError(
            f"join_uneven_inputs needs the DDP-wrapped model: got {type(model).__name__}. "
            "Pass the model returned by ddpkit.wrap_model(..., strategy='ddp')."
        )
    problem = join_with_local_sgd(True, None) if gradients_local(model) else None
    if problem:
        raise ConfigError(f"join_uneven_inputs: {problem}.")
    return _joined(model)


@contextlib.contextmanager
def _joined(model: DistributedDataParallel) -> Iterator[None]:
    """torch's ``Join([model])`` with the straggler exchange paused (not a DDP collective,
    so Join would not shadow it for a rank that ran out of data)."""
    with paused(), Join([model]):
        yield
