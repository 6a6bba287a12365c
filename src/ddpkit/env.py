"""Where this process sits in the job: rank, local rank, world size, node rank.

Read from the launcher's environment variables, in this order:

1. torchrun / ``ddpkit run`` / ``torch.distributed.run``: ``RANK``, ``WORLD_SIZE``,
   ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the node rank).
2. Slurm ``srun`` tasks: ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` (else ``SLURM_NTASKS``),
   ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_STEP_TASKS_PER_NODE``. Only used when the step has
   more than one task, so a plain ``python train.py`` inside an allocation stays a single process.
3. Nothing: a plain single process (rank 0 of world size 1).

Under ``srun`` the rendezvous address comes from :func:`slurm_rendezvous_defaults` where the job
did not export ``MASTER_ADDR``/``MASTER_PORT``.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ddpkit.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class ProcessInfo:
    """The coordinates of one process in a job.

    Attributes:
        rank: global rank, ``0 <= rank < world_size``.
        local_rank: rank on this node, ``0 <= local_rank < local_world_size``.
        world_size: number of processes in the job.
        local_world_size: number of processes on this node.
        node_rank: index of this node, ``0 <= node_rank < num_nodes``.
        source: which launcher the values came from: ``"torchrun"``, ``"slurm"`` or ``"none"``.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    source: str = "none"

    @property
    def is_distributed(self) -> bool:
        """True when more than one process takes part in the job."""
        return self.world_size > 1

    @property
    def is_rank_zero(self) -> bool:
        """True on global rank 0, the one process that logs and writes replicated state."""
        return self.rank == 0

    @property
    def prefix(self) -> str:
        """``[rank r/N]``, the tag ddpkit puts in front of warnings and errors from a worker."""
        return f"[rank {self.rank}/{self.world_size}]"


def _int(environ: Mapping[str, str], name: str) -> int:
    raw = environ[name]
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(
            f"invalid launcher variable: {name}={raw!r}. It must be an integer. "
            f"Unset it or start the job with torchrun / ddpkit run."
        ) from None


def _slurm_tasks_per_node(environ: Mapping[str, str], node_rank: int) -> int | None:
    """Parse ``SLURM_STEP_TASKS_PER_NODE`` such as ``"2(x3),1"`` for this node."""
    spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return None
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[node_rank] if node_rank < len(counts) else None


def detect_process_info(environ: Mapping[str, str] | None = None) -> ProcessInfo:
    """Read rank, local rank, world size and node rank from the launcher's variables.

    Args:
        environ: the variables to read; ``os.environ`` when omitted.

    Returns:
        The :class:`ProcessInfo`. Without launcher variables: rank 0 of world size 1.

    Raises:
        ConfigError: a variable is not an integer, or the values contradict each other
            (``rank >= world_size``, ``local_rank >= local_world_size``), or ``WORLD_SIZE`` > 1
            is set without ``RANK`` (the process was not started by a launcher).

    Example:
        >>> detect_process_info({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}).rank
        1
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world_size = _int(env, "WORLD_SIZE")
        local_rank = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0
        local_world_size = (
            _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world_size
        )
        info = ProcessInfo(
            rank=_int(env, "RANK"),
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world_size,
            node_rank=_int(env, "GROUP_RANK") if "GROUP_RANK" in env else 0,
            source="torchrun",
        )
    elif (
        "SLURM_PROCID" in env
        and int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or "1") > 1
    ):
        world_size = int(env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"])
        node_rank = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
        info = ProcessInfo(
            rank=_int(env, "SLURM_PROCID"),
            local_rank=_int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
            world_size=world_size,
            local_world_size=_slurm_tasks_per_node(env, node_rank) or world_size,
            node_rank=node_rank,
            source="slurm",
        )
    elif "WORLD_SIZE" in env and _int(env, "WORLD_SIZE") > 1:  # set by hand, no launcher
        n = _int(env, "WORLD_SIZE")
        raise ConfigError(
            f"WORLD_SIZE={n} is set but RANK is not, so no launcher started this process and it "
            f"would train alone, as rank 0 of 1. Start the {n} ranks with a launcher (`ddpkit run "
            f"-n {n} script.py`, `ddpkit train --nproc {n}`, or `torchrun --nproc-per-node {n} "
            "script.py`), or unset WORLD_SIZE."
        )
    else:
        return ProcessInfo()
    _validate(info)
    return info


def _validate(info: ProcessInfo) -> None:
    problems = []
    if info.world_size < 1:
        problems.append(f"world_size={info.world_size} must be >= 1")
    if not 0 <= info.rank < info.world_size:
        problems.append(f"rank={info.rank} must be in [0, world_size={info.world_size})")
    if not 0 <= info.local_rank < info.local_world_size:
        problems.append(
            f"local_rank={info.local_rank} must be in [0, local_world_size={info.local_world_size})"
        )
    if problems:
        raise ConfigError(
            f"inconsistent launcher variables ({info.source}): {'; '.join(problems)}. "
            "Start the job with torchrun or ddpkit run, which set them consistently."
        )


def slurm_rendezvous_defaults(
    info: ProcessInfo, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The rendezvous variables an ``srun`` step left unset that Slurm itself determines.

    - ``MASTER_PORT``: the first port Slurm reserved for this step, from
      ``SLURM_STEP_RESV_PORTS`` (``"12000-12002"`` or ``"12000"``; srun sets it where
      slurm.conf has ``MpiParams=ports=LOW-HIGH``). Every task of the step sees the same ports
      and Slurm gives no two running steps the same, so concurrent jobs never collide.
    - ``MASTER_ADDR``: ``127.0.0.1`` when the step runs on one node (``SLURM_STEP_NUM_NODES``
      is 1), and then ``GLOO_SOCKET_IFNAME=lo``, so the store and gloo listen on loopback only.
      On several nodes rank 0's address is not guessed.

    Args:
        info: this process's coordinates; only ``source == "slurm"`` gets defaults.
        environ: the variables to read; ``os.environ`` when omitted.

    Returns:
        Only the names that are unset and that Slurm's variables determine; ``{}`` outside an
        srun step, or when the job exported them itself.

    Example:
        >>> slurm = ProcessInfo(world_size=2, local_world_size=2, source="slurm")
        >>> slurm_rendezvous_defaults(slurm, {"SLURM_STEP_NUM_NODES": "1",
        ...                                   "SLURM_STEP_RESV_PORTS": "12000-12002"})
        {'MASTER_PORT': '12000', 'MASTER_ADDR': '127.0.0.1', 'GLOO_SOCKET_IFNAME': 'lo'}
    """
    env = os.environ if environ is None else environ
    if info.source != "slurm":
        return {}
    defaults: dict[str, str] = {}
    ports = re.fullmatch(r"(\d+)(?:-\d+)?", env.get("SLURM_STEP_RESV_PORTS", "").strip())
    if "MASTER_PORT" not in env and ports is not None:
        defaults["MASTER_PORT"] = ports.group(1)
    one_node = (env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES")) == "1"
    if "MASTER_ADDR" not in env and one_node:
        defaults["MASTER_ADDR"] = "127.0.0.1"
        if "GLOO_SOCKET_IFNAME" not in env:
            defaults["GLOO_SOCKET_IFNAME"] = "lo"
    return defaults


def descendant_pids(pid: int) -> list[int]:
    """Every process below ``pid`` (its children, theirs, ...), nearest first, read from
    ``/proc`` (Linux; ``[]`` elsewhere). Not a collective. A process whose parent ended belongs
    to init (or a subreaper) and is no longer found."""
    parent_of: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    with open(f"/proc/{entry}/stat") as handle:
                        parent_of[int(entry)] = int(handle.read().rsplit(")", 1)[1].split()[1])
    found, frontier = [], {pid}
    while frontier:
        frontier = {child for child, parent in parent_of.items() if parent in frontier}
        found += sorted(frontier)
    return found
