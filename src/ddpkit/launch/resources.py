"""Does ``--nproc N`` fit on this machine? Memory per rank against what is available, and
processes against usable cores, checked before any worker starts.

Without it, ``--nproc 64`` on 2 cores and 24 GiB started 64 workers that printed nothing for
150 s while they ate the memory.
"""

from __future__ import annotations

import os

from ddpkit.errors import ConfigError

# Peak private memory (RssAnon, from /proc/PID/status sampled every 50 ms) of one rank of
# `ddpkit run -n 2` running `import torch, ddpkit; init_runtime(); all_reduce(4 floats)`:
# 145 MiB, plus 3 MiB for its stderr copier (2 CPU cores, torch 2.13.0+cpu, gloo). What any
# script's rank needs at least; a script's own tensors come on top.
BARE_RANK_MIB = 150.0
MIB = 2**20


def available_memory_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (``None`` where there is no such file)."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file counts in KiB
    except OSError:
        return None
    return None


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), else ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def check_fits(
    nproc: int,
    *,
    mem_per_rank_mib: float = BARE_RANK_MIB,
    what: str = "a bare torch + gloo rank",
    flag: str = "--nproc",
    available_bytes: int | None = None,
    cores: int | None = None,
) -> str | None:
    """Refuse ``nproc`` ranks that cannot fit in the available memory; warn past the cores.

    Args:
        nproc: processes to start on this machine.
        mem_per_rank_mib: peak private memory of one rank, MiB (measured; see the callers).
        what: what that figure was measured on, for the message.
        flag: the option the user set, for the message.
        available_bytes: ``MemAvailable`` (read from ``/proc/meminfo`` when omitted; no check
            where it cannot be read).
        cores: usable cores (this process's CPU affinity when omitted).

    Returns:
        A one-line warning when ``nproc`` exceeds the usable cores, else ``None``.

    Raises:
        ConfigError: ``nproc * mem_per_rank_mib`` exceeds the available memory; names the
            figure and the largest count that fits.

    Example:
        >>> check_fits(64, mem_per_rank_mib=730, available_bytes=24 * 2**30, cores=2)
        Traceback (most recent call last):
        ddpkit.errors.ConfigError: --nproc 64 does not fit in memory: ... at most 33 ...
    """
    available = available_memory_bytes() if available_bytes is None else available_bytes
    if available is not None and nproc * mem_per_rank_mib * MIB > available:
        fit = int(available // (mem_per_rank_mib * MIB))
        advice = f"use {flag} {fit} or fewer" if fit >= 1 else "free memory first"
        raise ConfigError(
            f"{flag} {nproc} does not fit in memory: {nproc} ranks x about "
            f"{mem_per_rank_mib:.0f} MiB each ({what}, measured peak) = "
            f"{nproc * mem_per_rank_mib / 1024:.1f} GiB, {available / 2**30:.1f} GiB available; "
            f"at most {fit} fit: {advice}."
        )
    cores = usable_cores() if cores is None else cores
    if nproc > cores:
        return (
            f"warning: {flag} {nproc} processes on {cores} usable cores: they take turns on the "
            f"cores (1 thread each), so the job runs no faster than with {flag} {cores}."
        )
    return None
