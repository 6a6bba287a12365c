"""Dynamic models under DDP: which parameters got no gradient, and which fix applies.

DDP expects every parameter to get a gradient in every synced backward. When one does not, its
bucket is never all-reduced and the *next* forward fails with "Expected to have finished
reduction in the prior iteration before starting a new one", listing only parameter indices
(names need ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, which on torch 2.13 with gloo segfaults).

:class:`UnusedParameterDiagnosis` works the names out itself, from the autograd graph of the
previous synced iteration, and tells the two causes apart:

- not used in forward (no path from the module's outputs to the parameter): a branch skipped,
  a layer built but never called -> ``find_unused_parameters=True``
  (``ddpkit train --find-unused-parameters``), or ``static_graph=True`` when the set of unused
  parameters is the same every iteration;
- used in forward, but the output it produced is not part of the loss (a path from the outputs,
  none from the loss) -> use that output in the loss, or do not return it (``.detach()`` it).
  ``find_unused_parameters=True`` also copes with it (DDP supports outputs left out of the loss
  in that mode since torch 1.9, pytorch/pytorch#57081; checked on 2.13 in
  ``tests/distributed/test_dynamic.py``), at the price of a graph traversal per iteration.

Cost: a forward hook keeps a reference to the last forward's output ``grad_fn``\\s and
:meth:`UnusedParameterDiagnosis.record_loss` to the last synced loss's (graph nodes only; the
saved activations are freed by backward as usual, except those of outputs that never enter a
backward, which live until the next forward). The graph is walked only when the error happens.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from ddpkit.errors import DistributedError
from ddpkit.parallel.wrap import unwrap_model
from ddpkit.runtime.process_group import Runtime

UNFINISHED_REDUCTION = "Expected to have finished reduction in the prior iteration"
_INDICES = re.compile(r"did not receive grad for rank \d+: ([\d ]+)")


class UnusedParameterError(DistributedError):
    """A DDP parameter got no gradient in the previous iteration (names and fix included)."""


def _grad_fns(value: Any) -> list[Any]:
    """The ``grad_fn`` of every tensor in a (nested) output that requires grad."""
    if isinstance(value, torch.Tensor):
        return [value.grad_fn] if value.grad_fn is not None else []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [fn for item in value for fn in _grad_fns(item)]
    return []


def reachable_parameters(grad_fns: list[Any]) -> set[int]:
    """``id``\\s of the leaf tensors (parameters) the autograd graph from ``grad_fns`` reaches."""
    found: set[int] = set()
    seen: set[Any] = set()
    stack = list(grad_fns)
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if isinstance(variable, torch.Tensor):
            found.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


class UnusedParameterDiagnosis:
    """Turn DDP's unfinished-reduction error into one naming parameters and the fix.

    Args:
        model: the DDP-wrapped (or plain) model.
        runtime: names the rank in messages (``[rank 1/2] ...``) when given.

    Use :meth:`attach` (a forward hook), call :meth:`record_loss` with each synced iteration's
    loss before its backward, and :meth:`explain` on a ``RuntimeError`` from forward.
    :class:`~ddpkit.training.accumulation.GradientAccumulator` does all three.

    Example:
        >>> diagnosis = UnusedParameterDiagnosis(ddp_model, rt)
        >>> handles = diagnosis.attach()
        >>> try:
        ...     out = ddp_model(x)
        ... except RuntimeError as exc:
        ...     raise diagnosis.explain(exc) or exc
    """

    def __init__(self, model: nn.Module, runtime: Runtime | None = None) -> None:
        self.model = model
        self.prefix = f"[rank {runtime.rank}/{runtime.world_size}] " if runtime else ""
        self._output_fns: list[Any] = []
        self._synced_output_fns: list[Any] = []
        self._loss_fns: list[Any] = []

    def attach(self) -> list[Any]:
        """Register the forward hook on ``model``; returns the handles (``.remove()`` them)."""
        return [self.model.register_forward_hook(self._after_forward)]

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            self._output_fns = _grad_fns(output)

    def record_loss(self, loss: torch.Tensor) -> None:
        """Remember the loss of a synced backward (call before its ``backward``)."""
        self._loss_fns = _grad_fns(loss)
        self._synced_output_fns = self._output_fns

    def _parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in unwrap_model(self.model).named_parameters() if p.requires_grad]

    def unused_parameters(self, exc: RuntimeError | None = None) -> tuple[list[str], list[str]]:
        """``(not used in forward, used but not in the loss)`` of the last synced iteration.

        From the recorded graphs; without a recorded loss, from the indices in DDP's message
        ``exc`` (all then counted as not used in forward unless the outputs reach them).
        """
        params = self._parameters()
        from_outputs = reachable_parameters(self._synced_output_fns or self._output_fns)
        if self._loss_fns:
            from_loss = reachable_parameters(self._loss_fns)
            missing = [(n, p) for n, p in params if id(p) not in from_loss]
        else:
            match = _INDICES.search(str(exc)) if exc is not None else None
            indices = [int(i) for i in match.group(1).split()] if match else []
            missing = [params[i] for i in indices if i < len(params)]
        not_in_forward = [n for n, p in missing if id(p) not in from_outputs]
        not_in_loss = [n for n, p in missing if id(p) in from_outputs]
        return not_in_forward, not_in_loss

    def explain(self, exc: BaseException) -> UnusedParameterError | None:
        """An :class:`UnusedParameterError` for DDP's unfinished-reduction error, else ``None``."""
        if not isinstance(exc, RuntimeError) or UNFINISHED_REDUCTION not in str(exc):
            return None
        not_in_forward, not_in_loss = self.unused_parameters(exc)
        parts = []
        if not_in_forward:
            parts.append(
                f"not used in forward: {', '.join(not_in_forward)} -> wrap with "
                "find_unused_parameters=True (ddpkit train --find-unused-parameters), or "
                "static_graph=True if the same parameters are unused every iteration"
            )
        if not_in_loss:
            parts.append(
                f"returned by forward but not part of the loss: {', '.join(not_in_loss)} -> "
                "use that output in the loss, or do not return it (or detach it); "
                "find_unused_parameters=True also tolerates it, at a graph traversal per step"
            )
        if not parts:
            parts.append("the parameters could not be identified from the autograd graph")
        return UnusedParameterError(
            f"{self.prefix}DDP: parameters received no gradient in the previous iteration, so "
            f"their gradient bucket was never all-reduced: {'; '.join(parts)}."
        )
