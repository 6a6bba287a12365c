"""The allowed values of the training step's string settings, without torch (``ddpkit train``'s
flags and help read them before anything imports torch); :mod:`ddpkit.training.precision` acts
on them."""

from __future__ import annotations

__all__ = ["PRECISIONS"]

PRECISIONS = ("32", "bf16-mixed", "16-mixed")
