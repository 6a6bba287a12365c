"""The one-cycle LR schedule of ``ddpkit train``, stepped by optimizer steps or, with live fault
tolerance, by the loader's position.

``OneCycleLR`` is built for a fixed number of steps (``steps_per_epoch * epochs``) and raises
when stepped past it. With live fault tolerance an epoch's number of steps changes with the
members (half the ranks: twice the steps, each of half the global batch), so counting steps
would run past the end (torch's ``ValueError: Tried to step 1801 times``, seen in a goodput
trial) and bend the LR curve. There the schedule follows the epoch's progress instead: after
each step it stands at ``epoch * steps_per_epoch + floor(fraction of the epoch's samples done *
steps_per_epoch)``, read from the loader's global position, which every member shares (and a
replacement receives when it heals), so every replica's LR is the same and the schedule ends
where it would have, whatever the members did on the way.
"""

from __future__ import annotations

from typing import Any

from torch.optim.lr_scheduler import LRScheduler

from ddpkit.training.step import StepResult


class LRStepper:
    """Steps ``schedule`` after each optimizer step (see the module docstring).

    Args:
        schedule: the LR schedule (its ``total_steps``, when it has one, is never passed).
        epochs: ``None``: one schedule step per optimizer step taken (not skipped); else the
            schedule follows the loader's position (live fault tolerance), at
            ``schedule.total_steps // epochs`` schedule steps per epoch, read at every step:
            a replacement's schedule was built for the world size it started at, and its
            ``total_steps`` comes from the live peer that healed it.
    """

    def __init__(self, schedule: LRScheduler, epochs: int | None = None) -> None:
        self.schedule = schedule
        self.epochs = epochs

    @property
    def by_position(self) -> bool:
        """Whether :meth:`step` reads the loader's position (live fault tolerance)."""
        return self.epochs is not None

    def step(self, result: StepResult, position: dict[str, Any]) -> None:
        """After one optimizer step; ``position``: the loader's ``state_dict()`` after it (read
        only when :attr:`by_position`)."""
        if self.epochs is None:
            if not result.skipped:
                self.schedule.step()
            return
        limit = int(self.schedule.total_steps)  # type: ignore[attr-defined]
        per_epoch = limit // max(self.epochs, 1)
        done, end = position.get("samples_done", 0), position.get("epoch_samples", 0)
        fraction = done / end if end else 0.0
        target = int(position["epoch"]) * per_epoch + int(fraction * per_epoch)
        target = min(target, limit)
        while self.schedule.last_epoch < target:
            self.schedule.step()
