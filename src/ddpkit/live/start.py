"""Joining a live fault-tolerant job from :func:`ddpkit.init_runtime`."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from ddpkit.env import ProcessInfo
from ddpkit.errors import ConfigError, DistributedError
from ddpkit.live.membership import LiveMembership
from ddpkit.live.protocol import MODES, REPLICA_ENV, SLOT_ENV, STORE_ENV

MODE_ENV = "DDPKIT_FAULT_TOLERANCE"  # set by ddpkit run --fault-tolerance
ROLE_ENV = "DDPKIT_LIVE_ROLE"  # "initial" (the first quorum) or "replacement" (healed later)


def wants_live(mode: str | None) -> bool:
    """Whether this process joins a live fault-tolerant job.

    ``mode`` ``None`` reads ``DDPKIT_FAULT_TOLERANCE`` (``ddpkit run --fault-tolerance``). A
    single process (``python train.py``) with ``"live"`` has no peer to lose: it runs as usual.

    Raises:
        ConfigError: an unknown mode; ``"live"`` in a multi-process job that ``ddpkit run
            --fault-tolerance live`` did not start (torchrun and Slurm restart or end every
            rank when one fails, so the survivors cannot go on).
    """
    chosen = mode or os.environ.get(MODE_ENV) or "restart"
    if chosen not in MODES:
        raise ConfigError(
            f"unknown fault tolerance: fault_tolerance={chosen!r}. Allowed: "
            f"{', '.join(MODES)}. 'restart' ends (or restarts) every rank when one fails; "
            "'live' keeps the survivors training."
        )
    if chosen != "live":
        return False
    if STORE_ENV in os.environ:
        return True
    if int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")) or 1) > 1:
        raise ConfigError(
            "fault_tolerance='live' needs its launcher: start the job with ddpkit run "
            "--fault-tolerance live -n N script.py (torchrun and srun end or restart every "
            "rank when one fails, so no survivor could go on). Or use fault_tolerance="
            "'restart'."
        )
    return False


def join_live(
    info: ProcessInfo,
    backend: str,
    device: torch.device,
    init_timeout_s: float,
    train_timeout_s: float,
) -> LiveMembership:
    """Connect to the launcher's store, register, and (a worker of the first quorum) form it.

    A replacement (``DDPKIT_LIVE_ROLE=replacement``) only registers: it is taken in and healed
    from a live peer in :meth:`CheckpointManager.resume <ddpkit.CheckpointManager.resume>`.

    Raises:
        ConfigError: ``backend="nccl"`` (not built).
        DistributedError: the store cannot be reached, or no quorum formed within
            ``init_timeout_s``.
    """
    if backend == "nccl":
        raise ConfigError(
            "live fault tolerance with backend='nccl' is not built yet: a failing member would "
            "need ProcessGroupNCCL's abort() where gloo's connections are shut down, and it was "
            "never run on a GPU. Use backend='gloo', or fault_tolerance='restart'."
        )
    host, _, port = os.environ[STORE_ENV].rpartition(":")
    timeout = datetime.timedelta(seconds=init_timeout_s)
    try:
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        heartbeat = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    except dist.DistNetworkError:
        raise DistributedError(
            f"live fault tolerance: cannot reach the launcher's store at {host}:{port} within "
            f"{init_timeout_s:g} s. Start the job with ddpkit run --fault-tolerance live."
        ) from None
    membership = LiveMembership(
        store,
        os.environ[REPLICA_ENV],
        heartbeat_store=heartbeat,
        backend=backend,
        device=device,
        formation_timeout_s=min(60.0, init_timeout_s),
        train_timeout_s=train_timeout_s,
        hang_timeout_s=min(60.0, train_timeout_s),
    )
    membership.register(int(os.environ.get(SLOT_ENV, info.rank)))
    if os.environ.get(ROLE_ENV, "initial") == "initial":
        membership.wait_for_quorum(0, init_timeout_s)  # the launcher's first quorum
        membership.reconfigure("start")
    return membership
