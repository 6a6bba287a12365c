"""The allowed values of the process group's string settings, without torch (``ddpkit train``'s
flags and help read them before anything imports torch); :mod:`ddpkit.runtime.process_group`
acts on them."""

from __future__ import annotations

__all__ = ["BACKENDS"]

BACKENDS = ("auto", "gloo", "nccl")
