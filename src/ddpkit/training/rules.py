"""The training step's rules that tie two settings together, stated once and without torch.

The library raises them (:class:`~ddpkit.training.accumulation.GradientAccumulator`,
:func:`~ddpkit.training.uneven.join_uneven_inputs`); ``ddpkit train`` lists them among its
config's problems before anything imports torch. Each returns the rule broken, one line without
its final period, or ``None``.

Example:
    >>> from ddpkit.training.rules import static_graph_with_accumulation
    >>> static_graph_with_accumulation(True, 2, name="grad_accum")
    "static_graph=True with grad_accum=2. torch's DDP breaks no_sync in static-graph mode ..."
    >>> print(static_graph_with_accumulation(True, 1))  # no accumulation: nothing broken
    None
"""

from __future__ import annotations

__all__ = ["join_with_local_sgd", "static_graph_with_accumulation"]


def static_graph_with_accumulation(
    static_graph: bool, num_micro_steps: int, *, name: str = "num_micro_steps"
) -> str | None:
    """DDP's static graph cannot skip the gradient sync of gradient accumulation's micro-steps.

    Args:
        static_graph: the DDP model's ``static_graph``.
        num_micro_steps: micro-batches per optimizer step.
        name: what the caller calls ``num_micro_steps`` (``ddpkit train``: ``grad_accum``).
    """
    if not static_graph or num_micro_steps <= 1:
        return None
    return (
        f"static_graph=True with {name}={num_micro_steps}. torch's DDP breaks no_sync in "
        "static-graph mode (pytorch/pytorch#143580), and accumulation skips the gradient sync "
        f"of every micro-step but the last. Drop static_graph (--static-graph), or set {name}=1"
    )


def join_with_local_sgd(join: bool, sync_every: int | None) -> str | None:
    """torch's Join cannot stand in for a finished rank in local SGD's parameter averaging.

    Args:
        join: whether the epoch runs inside :func:`~ddpkit.training.uneven.join_uneven_inputs`.
        sync_every: local SGD's period H (1: gradients all-reduced every step, no local SGD);
            ``None``: local SGD with a period not known here.
    """
    if not join or sync_every == 1:
        return None
    period = "local SGD" if sync_every is None else f"sync_every={sync_every}"
    return (
        f"{period} with join=True. Join cannot stand in for a finished rank in local SGD's "
        "parameter averaging, so the others would wait. Drop join and give every rank the same "
        "number of batches (ddpkit.training.uneven.verify_even_batches), or use sync_every=1"
    )
