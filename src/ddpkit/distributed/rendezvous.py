"""Rendezvous that says who is missing: the store, each rank's claim, and the wait for all ranks.

torch's own rendezvous, when a rank never comes, ends after the init timeout with a message about
a store key or a socket, and two processes that both think they are rank 0 can hang or fail far
from the cause. Before ``init_process_group`` ddpkit has every rank claim its rank in the store
(``compare_set``: first claim wins) and count itself in, then waits for the count to reach
``world_size``, so it can report:

- ``rendezvous timed out after 5 s: 2 of 4 ranks joined (missing 2, 3)``;
- ``rank 0 is claimed by two processes: host:pid 11 and host:pid 12`` (on both processes).

It also makes the store itself (when torchrun's agent does not provide one) and turns the two
classic store failures into one line with the fix: the master address unreachable, and the port
already in use.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import uuid

import torch.distributed as dist

from ddpkit.distributed.env import ProcessInfo
from ddpkit.errors import ConfigError, DistributedError
from ddpkit.log import get_logger

PREFIX = "ddpkit/join"
PROGRESS_EVERY_S = 10.0


def format_ranks(ranks: list[int]) -> str:
    """``[2, 3, 5, 6, 7]`` -> ``"2, 3, 5-7"`` (runs of three or more are shortened)."""
    parts: list[str] = []
    start = prev = None
    for rank in sorted(ranks) + [None]:
        if start is not None and rank == prev + 1:
            prev = rank
            continue
        if start is not None:
            span = prev - start
            parts.append(
                f"{start}-{prev}" if span >= 2 else ", ".join(map(str, range(start, prev + 1)))
            )
        start = prev = rank
    return ", ".join(parts)


def make_store(info: ProcessInfo, timeout_s: float) -> dist.TCPStore:
    """The job's TCPStore from ``MASTER_ADDR``/``MASTER_PORT``: rank 0 serves it, others connect.

    Raises:
        ConfigError: the port is already in use on rank 0's machine.
        DistributedError: a rank cannot reach the store within ``timeout_s``.
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    is_master = info.rank == 0
    try:
        return dist.TCPStore(
            host,
            port,
            info.world_size,
            is_master=is_master,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,  # join() waits, and says who is missing
        )
    except dist.DistNetworkError as exc:
        raise translate_store_error(exc, host, port, is_master, timeout_s) from None


def translate_store_error(
    exc: BaseException, host: str, port: int, is_master: bool, timeout_s: float
) -> Exception:
    """The one-line ddpkit error for a TCPStore that could not listen or connect."""
    text = str(exc)
    if is_master and ("EADDRINUSE" in text or "address already in use" in text.lower()):
        return ConfigError(
            f"cannot start the rendezvous store: port {port} on {host} is already in use "
            "(MASTER_PORT). Pick another free port, or launch with `ddpkit run`, which lets the "
            "system pick one."
        )
    if is_master:
        return DistributedError(
            f"cannot start the rendezvous store on {host}:{port}: {text.splitlines()[0]}. Check "
            "that MASTER_ADDR is an address of this machine (rank 0 serves the store)."
        )
    return DistributedError(
        f"cannot reach the rendezvous store at {host}:{port} (MASTER_ADDR:MASTER_PORT) within "
        f"{timeout_s:g} s. Check that rank 0 is running and started first, that {host} is rank "
        f"0's address as seen from this machine, and that no firewall blocks port {port}."
    )


def _owner(claim: str) -> str:
    host, pid, _ = claim.rsplit(":", 2)
    return f"{host} pid {pid}"


def _duplicate_error(rank: int, claims: str) -> DistributedError:
    return DistributedError(
        f"rank {rank} is claimed by two processes ({claims}). Every process needs its own rank: "
        "check RANK / --node-rank and that the same job was not started twice."
    )


def join(store: dist.Store, info: ProcessInfo, timeout_s: float, poll_s: float = 0.05) -> None:
    """Claim this rank in ``store`` and wait until all ``world_size`` ranks have joined.

    Collective: call on every rank, before ``init_process_group`` with the same store.

    Raises:
        DistributedError: another process already claimed this rank (raised on both); or fewer
            than ``world_size`` ranks joined within ``timeout_s`` seconds -- the message gives
            how many joined and which ranks are missing.
    """
    me = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    owner = store.compare_set(f"{PREFIX}/rank/{info.rank}", "", me).decode()
    if owner != me:
        claims = f"{_owner(owner)} and {_owner(me)}"
        store.set(f"{PREFIX}/duplicate", f"{info.rank}|{claims}")
        raise _duplicate_error(info.rank, claims)
    store.add(f"{PREFIX}/count", 1)
    log = get_logger("rendezvous")
    start = last_note = time.monotonic()
    while store.add(f"{PREFIX}/count", 0) < info.world_size:
        if store.check([f"{PREFIX}/duplicate"]):
            rank, claims = store.get(f"{PREFIX}/duplicate").decode().split("|", 1)
            raise _duplicate_error(int(rank), claims)
        waited = time.monotonic() - start
        if waited >= timeout_s:
            raise DistributedError(
                f"rendezvous timed out after {timeout_s:g} s: {_who_joined(store, info)}. Start "
                f"every rank of world_size={info.world_size}, or lower the world size "
                "(--nproc / WORLD_SIZE)."
            )
        if time.monotonic() - last_note >= PROGRESS_EVERY_S:
            last_note = time.monotonic()
            log.warning("waiting for ranks (%.0f s): %s", waited, _who_joined(store, info))
        time.sleep(poll_s)


def _who_joined(store: dist.Store, info: ProcessInfo) -> str:
    missing = [r for r in range(info.world_size) if not store.check([f"{PREFIX}/rank/{r}"])]
    joined = info.world_size - len(missing)
    return f"{joined} of {info.world_size} ranks joined (missing {format_ranks(missing)})"
