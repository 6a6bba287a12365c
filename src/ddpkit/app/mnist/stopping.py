"""``ddpkit train`` and a stop signal: does a save fit in the grace period, measured at start-up.

After a stop signal the launcher waits ``--grace-period`` seconds before it SIGKILLs the ranks.
In that time the ranks reach the next stop check (at most ``MAX_CHECK_GAP_S`` of training, see
:mod:`ddpkit.runtime.stop`), finish the step and write one checkpoint. Rank 0 times one
throwaway write of the job's state at start-up and says, in one line, when the two cannot fit.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ddpkit.checkpoint.io import probe_write_s
from ddpkit.checkpoint.manager import CheckpointManager
from ddpkit.checkpoint.objects import is_zero_optimizer
from ddpkit.checkpoint.sharded import sharded_entries
from ddpkit.parallel.wrap import model_state_dict
from ddpkit.runtime.process_group import Runtime
from ddpkit.runtime.stop import MAX_CHECK_GAP_S, grace_period_s


def grace_warning(save_s: float, grace_s: float) -> str | None:
    """The start-up line when a save (``save_s``, measured) plus the way to the next stop check
    does not fit in ``grace_s``; ``None`` when it does.

    Example:
        >>> grace_warning(0.2, 30) is None
        True
    """
    needed_s = save_s + MAX_CHECK_GAP_S
    if needed_s <= grace_s:
        return None
    return (
        f"ddpkit train: warning: a checkpoint write takes {save_s:.1f} s here (measured at "
        f"start-up) and a stop needs up to {MAX_CHECK_GAP_S:g} s more to reach a step: "
        f"{needed_s:.1f} s does not fit in --grace-period {grace_s:g}: after a stop signal the "
        f"ranks would be killed before the checkpoint is complete (the previous one stands). "
        f"Raise --grace-period to at least {int(needed_s * 1.5) + 1}."
    )


def check_grace_period(ckpt: CheckpointManager, runtime: Runtime) -> float | None:
    """Rank 0: time one write of ``ckpt``'s state and print :func:`grace_warning` if it does not
    fit the launcher's grace period. Returns the seconds measured (``None``: not measured,
    because no launcher SIGKILLs this job or this is not rank 0). Not a collective.

    Sharded state (``fsdp``, ``zero1``: every rank writes its own shard in parallel) is timed
    as rank 0's own shard; no collective is run (an FSDP model's full state dict would be one).
    """
    grace_s = grace_period_s()
    if grace_s is None or not runtime.is_rank_zero:
        return None
    sharded = sharded_entries(ckpt.state, runtime)
    payload = {name: _local_state(obj, name in sharded) for name, obj in ckpt.state.items()}
    save_s = probe_write_s(ckpt.directory, payload)
    warning = grace_warning(save_s, grace_s)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    return save_s


def _local_state(obj: Any, sharded: bool) -> object:
    """What rank 0 itself writes of one entry (a checkpoint's ``state`` value: a module, an
    optimizer, any object with ``state_dict()``): the whole state, or its own shard."""
    if not sharded:
        return model_state_dict(obj) if isinstance(obj, torch.nn.Module) else obj.state_dict()
    if is_zero_optimizer(obj):
        return obj.optim.state_dict()  # this rank's part of ZeRO's state
    return _to_local(obj.state_dict())  # FSDP2's model and optimizer: local DTensor shards


def _to_local(value: object) -> object:
    if isinstance(value, dict):
        return {key: _to_local(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_local(item) for item in value)
    return value.to_local() if hasattr(value, "to_local") else value
