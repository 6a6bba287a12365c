"""The allowed values of the wrapping's string settings, without torch (``ddpkit train``'s flags
and help read them before anything imports torch); :mod:`ddpkit.parallel.wrap` and
:mod:`ddpkit.parallel.comm` act on them."""

from __future__ import annotations

__all__ = ["GRAD_COMPRESSIONS", "STRATEGIES"]

STRATEGIES = ("auto", "single", "ddp", "dp", "zero1", "fsdp")
GRAD_COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
