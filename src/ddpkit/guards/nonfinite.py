"""Cross-rank guards: a non-finite loss or gradient decided by all ranks together, step counters
compared (the replica-divergence check lives in :mod:`ddpkit.guards.replicas`).

Each check is one small all-reduce/all-gather, so every rank reaches the same decision: all
skip the step or all raise, and nobody waits in a collective the others skipped.
"""

from __future__ import annotations

import torch
from torch import nn

from ddpkit.errors import DistributedError
from ddpkit.guards.replicas import ReplicaDivergenceError, check_replicas
from ddpkit.runtime.collectives import gather_per_rank
from ddpkit.runtime.process_group import Runtime
from ddpkit.wrappers import local_tensor

__all__ = ["NonFiniteError", "NonFiniteGuard", "ReplicaDivergenceError", "check_replicas"]

MODES = ("skip", "raise")


class NonFiniteError(DistributedError):
    """A rank's loss or gradients held NaN/Inf (raised on every rank, naming the culprits)."""


def _local_nonfinite(loss: torch.Tensor, model: nn.Module) -> int:
    """2: the loss is non-finite; 1: only gradients are; 0: all finite.

    The flags are formed on the device and read once (one device-to-host sync per check, not
    one per parameter).
    """
    loss_bad = ~torch.isfinite(loss.detach()).all()
    # local_tensor: this rank's FSDP shard; a DTensor reduction would be a collective
    flags = [
        ~torch.isfinite(local_tensor(p.grad)).all().to(loss_bad.device)
        for p in model.parameters()
        if p.grad is not None
    ]
    grads_bad = torch.stack(flags).any() if flags else torch.zeros_like(loss_bad)
    return int(torch.where(loss_bad, 2, grads_bad.long()))  # the check's one read


class NonFiniteGuard:
    """Decide, across ranks, whether this step's loss and gradients are all finite.

    Call :meth:`check` after ``backward()`` and before ``optimizer.step()`` on every rank.

    Args:
        runtime: the job's :class:`~ddpkit.Runtime`.
        mode: ``"skip"`` (every rank skips the step and zeroes its gradients) or ``"raise"``
            (every rank raises :class:`NonFiniteError` naming the ranks and the step).

    Attributes:
        num_skipped: steps skipped so far (the same on every rank).
    """

    def __init__(self, runtime: Runtime, mode: str = "skip") -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode: mode={mode!r}. Allowed: {', '.join(MODES)}.")
        self.runtime = runtime
        self.mode = mode
        self.num_skipped = 0

    def check(self, step: int, loss: torch.Tensor, *, model: nn.Module) -> bool:
        """True when every rank's loss and gradients are finite (go ahead and step).

        Collective: call on every rank, every step. It also compares the ranks' ``step``
        counters, so a loop that skipped a step on one rank only is reported instead of
        averaging mismatched gradients or hanging later.

        Raises:
            NonFiniteError: in ``raise`` mode, when any rank is non-finite.
            DistributedError: the ranks passed different ``step`` values.
        """
        world = self.runtime.world_size
        # per rank: [2 = loss non-finite, 1 = gradients only, 0 = finite; step counter]
        table = gather_per_rank([_local_nonfinite(loss, model), step], self.runtime)
        report, steps = table[:, 0].tolist(), [int(s) for s in table[:, 1].tolist()]
        if len(set(steps)) > 1:
            listing = ", ".join(f"rank {r} at step {s}" for r, s in enumerate(steps))
            raise DistributedError(
                f"step counters differ across ranks: {listing}. A rank skipped or repeated a "
                "step on its own; make every rank take the same steps (use NonFiniteGuard's "
                "decision instead of a local one)."
            )
        bad_loss = [str(r) for r in range(world) if report[r] == 2]
        bad_grad = [str(r) for r in range(world) if report[r] == 1]
        if not bad_loss and not bad_grad:
            return True
        if self.mode == "raise":
            # DDP averages gradients, so one rank's NaN loss makes every rank's gradients NaN:
            # the loss flags name where it started.
            what = (
                f"non-finite loss at step {step} on rank(s) {', '.join(bad_loss)}"
                if bad_loss
                else f"non-finite gradients at step {step} on rank(s) {', '.join(bad_grad)}"
            )
            raise NonFiniteError(
                f"{what}. Lower the learning rate, check that step's inputs, or skip such steps "
                "(mode='skip')."
            )
        self.num_skipped += 1
        for param in model.parameters():
            param.grad = None
        return False
