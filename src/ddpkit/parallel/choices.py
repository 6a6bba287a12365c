"""The allowed values of the wrapping's string settings, and the world sizes each strategy runs
on, without torch (``ddpkit train``'s flags, help and config checks read them before anything
imports torch); :mod:`ddpkit.parallel.strategy` and :mod:`ddpkit.parallel.comm` act on them.

Example:
    >>> resolved_strategy("auto", 4), resolved_strategy("auto", 1), resolved_strategy("fsdp", 1)
    ('ddp', 'single', 'fsdp')
    >>> strategy_problems("auto", 1), strategy_problems("zero1", 2)
    ([], [])
    >>> strategy_problems("dp", 2)  # doctest: +ELLIPSIS
    ["strategy='dp' with world_size=2. It runs in one process. Use nproc=1 (--nproc 1), ..."]
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_CHECK_STEPS",
    "FSDP_PRECISION",
    "FSDP_RESHARD_AFTER_FORWARD",
    "GRAD_COMPRESSIONS",
    "ONE_PROCESS",
    "POWERSGD_RANK",
    "POWERSGD_START_STEP",
    "SEVERAL_PROCESSES",
    "STRATEGIES",
    "resolved_strategy",
    "runs_in_one_process",
    "strategy_problems",
]

STRATEGIES = ("auto", "single", "ddp", "dp", "zero1", "fsdp")
GRAD_COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
# PowerSGD's defaults in ddpkit: rank 1 factors (torch's PowerSGDState default), and 10 backward
# passes of plain all-reduce first (torch's default start_powerSGD_iter is 1,000; ddpkit starts
# early so that short jobs compress at all)
POWERSGD_RANK = 1
POWERSGD_START_STEP = 10
# FSDP's defaults in ddpkit (FSDP(), wrap_fsdp and --reshard-after-forward): ZeRO-3, float32
FSDP_RESHARD_AFTER_FORWARD = True
FSDP_PRECISION = "32"
# optimizer steps whose gradients are compared across ranks under compile (wrap_model's default,
# named in --compile's help)
DEFAULT_CHECK_STEPS = 3
ONE_PROCESS = ("single", "dp")  # strategies of one process (no process group)
SEVERAL_PROCESSES = ("ddp", "zero1", "fsdp")  # strategies that need a process group (2+ ranks)


def runs_in_one_process(name: str) -> bool:
    """True for a strategy of one process (``single``, ``dp``: ``--nproc 1`` by default)."""
    return name in ONE_PROCESS


def resolved_strategy(name: str, world_size: int) -> str:
    """The strategy that runs at ``world_size``: ``auto`` is ``ddp`` with 2 or more processes,
    else ``single`` (the one place ``auto`` is resolved); any other name is itself."""
    if name != "auto":
        return name
    return "ddp" if world_size > 1 else "single"


def strategy_problems(name: str, world_size: int) -> list[str]:
    """Why the strategy ``name`` cannot run with ``world_size`` processes, one line each
    (``[]``: it can). What ``Strategy.problems`` and ``ddpkit train``'s config check say."""
    resolved = resolved_strategy(name, world_size)
    if resolved in SEVERAL_PROCESSES and world_size < 2:
        return [
            f"strategy={resolved!r} with world_size={world_size}. It needs 2 or more processes. "
            "Use strategy='single', or start 2 or more processes (ddpkit run -n 2, "
            "ddpkit train --nproc 2, torchrun --nproc-per-node 2)"
        ]
    if resolved in ONE_PROCESS and world_size > 1:
        return [
            f"strategy={resolved!r} with world_size={world_size}. It runs in one process. "
            "Use nproc=1 (--nproc 1), or strategy='ddp' for several processes"
        ]
    return []
