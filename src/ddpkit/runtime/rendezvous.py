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
import errno
import ipaddress
import json
import os
import secrets
import socket
import threading
import time
import uuid

import torch.distributed as dist

from ddpkit.env import ProcessInfo
from ddpkit.errors import ConfigError, DistributedError
from ddpkit.log import get_logger
from ddpkit.runtime.hashseed import str_hash_probe
from ddpkit.security.bind import check_store_address, listening_socket
from ddpkit.security.token import TOKEN_ENV, TOKEN_FILE_ENV, mac, same

PREFIX = "ddpkit/join"
MAX_WORLD_SIZE_ENV = "DDPKIT_MAX_WORLD_SIZE"
PROGRESS_EVERY_S = 10.0


def format_ranks(ranks: list[int]) -> str:
    """``[2, 3, 5, 6, 7]`` -> ``"2, 3, 5-7"`` (runs of three or more are shortened)."""
    parts: list[str] = []
    start: int | None = None  # the open run's first rank
    prev = 0  # the open run's last rank (read only while a run is open)
    for rank in [*sorted(ranks), None]:
        if start is not None and rank is not None and rank == prev + 1:
            prev = rank
            continue
        if start is not None:
            span = prev - start
            parts.append(
                f"{start}-{prev}" if span >= 2 else ", ".join(map(str, range(start, prev + 1)))
            )
        if rank is None:
            break
        start = prev = rank
    return ", ".join(parts)


def check_local_route(host: str, timeout_s: float = 5.0) -> None:
    """Fail at once when this machine cannot connect to ``host``, one of its own addresses.

    A fresh network namespace (``unshare -n``, some containers) starts with the loopback
    interface down: 127.0.0.1 can still be bound, but nothing reaches it ("Network is
    unreachable"), and neither does anything sent to the machine's other own addresses (Linux
    delivers those through ``lo`` too). torch's TCPStore then retries for the whole init timeout
    and gloo reports "Unable to find interface for: [127.0.0.1]". One listen and one connect on
    ``host`` (well under a millisecond) find it first. An address that is not this machine's
    (rank 0's store elsewhere) or a name that does not resolve is left to the store to report.

    Not a collective; a no-op when ``host`` is fine.

    Raises:
        DistributedError: a connection to ``host`` on this machine fails; says how to fix it.

    Example:
        >>> check_local_route("127.0.0.1")  # passes silently where lo is up
    """
    try:
        # An AF_INET sockaddr is (address, port): str() only tells the type checker so.
        address = str(socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
    except (socket.gaierror, IndexError, UnicodeError):
        return
    with socket.socket() as listener, socket.socket() as client:
        try:
            listener.bind((address, 0))
            listener.listen(1)
        except OSError:  # not an address of this machine: its store is checked where it runs
            return
        client.settimeout(timeout_s)
        try:
            client.connect(listener.getsockname())
        except OSError as exc:
            raise _route_error(host, address, exc) from None


def _route_error(host: str, address: str, exc: OSError) -> DistributedError:
    named = address if host == address else f"{host} ({address})"
    why = exc.strerror or type(exc).__name__
    if exc.errno in (errno.ENETUNREACH, errno.EADDRNOTAVAIL):
        return DistributedError(
            f"the loopback interface is down: this machine cannot connect to its own address "
            f"{named} ({why}). Bring it up with `ip link set lo up` (a new network namespace or "
            "container starts with it down), then start the job again."
        )
    return DistributedError(
        f"this machine cannot connect to its own address {named} ({why}): a firewall rule or "
        "the network setup blocks local connections, which every rank of the job needs. Allow "
        "TCP on that address (check `ip link show lo` and the firewall), then start again."
    )


STORE_GRACE_S = 5.0  # past the timeout, torch's own error (a refused connection) comes first


def make_store(info: ProcessInfo, timeout_s: float) -> dist.TCPStore:
    """The job's TCPStore from ``MASTER_ADDR``/``MASTER_PORT``: rank 0 serves it, others connect.

    Rank 0 listens on ``MASTER_ADDR``'s address only (a socket bound by ddpkit, handed to the
    libuv store as ``master_listen_fd``), never on every interface; see
    :func:`ddpkit.security.bind.check_store_address` for which addresses are allowed.

    Raises:
        ConfigError: the port is already in use on rank 0's machine; a non-loopback address
            for a single-node job.
        DistributedError: a rank cannot reach the store within ``timeout_s``.
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if info.rank != 0:
        return connect_store(host, port, info.world_size, timeout_s)
    check_store_address(host, multi_node=info.world_size > info.local_world_size)
    return _serve_store(host, port, info.world_size, timeout_s)


def _serve_store(host: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's TCPStore, listening on ``host``'s address only (``port`` 0: a free one)."""
    listener = listening_socket(host, port)
    return dist.TCPStore(
        host,
        listener.getsockname()[1],
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,  # join() waits, and says who is missing
        master_listen_fd=listener.detach(),  # the store owns the bound socket from here
        use_libuv=True,
    )


ROUND_STORE_KEY = "ddpkit/round_store"  # in torchrun's agent store: "PORT NONCE"
_ROUND_NONCE_KEY = "ddpkit/round_nonce"  # in the round's own store


def round_store(info: ProcessInfo, timeout_s: float, poll_s: float = 0.1) -> dist.TCPStore:
    """The job's store under torchrun's shared agent store: a fresh one for each rendezvous round.

    torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``, its default) hands the workers its
    agents' TCPStore, which keeps every key across rounds, and a round restarted for a node
    waiting to join keeps ``TORCHELASTIC_RESTART_COUNT``: the new workers would meet the
    previous round's rank claims (and gloo its addresses, pytorch/pytorch#135712). So rank 0
    serves a store of its own for the round on a free port and publishes ``"PORT NONCE"`` in
    the agent store; the other ranks connect to that port (on 127.0.0.1 for one node, else at
    ``MASTER_ADDR``, the name that reached the agent store, hosted on rank 0's node) and take
    it once it holds the nonce. An earlier round's entry is skipped: its store is gone
    (torchrun stops a round's workers before the next rendezvous) or, its port reused, holds
    another nonce. Rank 0 listens on 127.0.0.1 for one node, else on ``MASTER_ADDR``'s address;
    if that name resolves to loopback on rank 0's node (Debian's 127.0.1.1 for the host name)
    the other nodes reach it through another address, so it listens on every interface, as
    torchrun's own store does, and says so.

    Raises:
        ConfigError: rank 0 cannot listen.
        DistributedError: the agent's store cannot be reached, or no store of this round was
            published within ``timeout_s``.
    """
    host, agent_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    deadline = time.monotonic() + timeout_s
    agent = connect_store(host, agent_port, info.world_size, timeout_s)
    multi_node = info.world_size > info.local_world_size
    if info.rank == 0:
        server = _serve_store(_round_address(host, multi_node), 0, info.world_size, timeout_s)
        nonce = secrets.token_hex(8)
        server.set(_ROUND_NONCE_KEY, nonce)
        agent.set(ROUND_STORE_KEY, f"{server.port} {nonce}")
        return server
    connect_to = host if multi_node else "127.0.0.1"
    skipped = ""
    while time.monotonic() < deadline:
        entry = agent.get(ROUND_STORE_KEY).decode() if agent.check([ROUND_STORE_KEY]) else ""
        if entry and entry != skipped:
            port, nonce = entry.split()
            client = _round_client(connect_to, int(port), nonce, info.world_size)
            if client is not None:
                client.set_timeout(datetime.timedelta(seconds=timeout_s))
                return client
            skipped = entry  # an earlier round's: read again until rank 0 publishes
        time.sleep(poll_s)
    raise DistributedError(
        f"rank {info.rank}: rank 0 did not reach init_runtime within {timeout_s:g} s (it "
        f"publishes this round's store in torchrun's store at {host}:{agent_port}; last entry "
        f"seen: {skipped or 'none'}): it is slow or stuck before it, did not start, or failed "
        "(its own output says why)."
    )


def _round_address(host: str, multi_node: bool) -> str:
    """Where rank 0 serves a round's store (see :func:`round_store`)."""
    if not multi_node:
        return "127.0.0.1"
    address = check_store_address(host, multi_node=True)
    if not ipaddress.ip_address(address).is_loopback:
        return address
    get_logger("rendezvous").warning(
        "MASTER_ADDR=%s resolves to %s on rank 0's node, which the other nodes cannot reach: "
        "the job's store listens on every interface, as torchrun's does (torchrun "
        "--local-addr ADDRESS avoids it)",
        host,
        address,
    )
    return "0.0.0.0"


def _round_client(host: str, port: int, nonce: str, world_size: int) -> dist.TCPStore | None:
    """A client of the store at ``host:port`` if it holds ``nonce``; else None (an earlier
    round's store: gone, or its port reused)."""
    try:
        client = connect_store(host, port, world_size, timeout_s=1.0)
        found = client.get(_ROUND_NONCE_KEY) if client.check([_ROUND_NONCE_KEY]) else b""
    except (DistributedError, RuntimeError):  # refused, reset, timed out: not this round's
        return None
    return client if found.decode() == nonce else None


def connect_store(host: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """A client of the TCPStore at ``host:port``, retrying until ``timeout_s``.

    Raises:
        DistributedError: the store cannot be reached in time, or what listens at ``host:port``
            is no store (it never answers; torch's client would wait past its timeout): one line,
            what to check.
    """
    result: dict[str, object] = {}

    def connect() -> None:  # torch's client waits past its timeout for a listener that is
        try:  # no store (it accepts, never answers): a thread, so that our deadline holds
            result["store"] = dist.TCPStore(
                host,
                port,
                world_size,
                is_master=False,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        except BaseException as exc:  # handed to the caller below
            result["error"] = exc

    thread = threading.Thread(target=connect, name="ddpkit-store-connect", daemon=True)
    thread.start()
    thread.join(timeout_s + STORE_GRACE_S)
    if thread.is_alive():
        raise DistributedError(
            f"no rendezvous store answered at {host}:{port} (MASTER_ADDR:MASTER_PORT) within "
            f"{timeout_s:g} s, and torch's client was still waiting: most likely another program "
            f"holds port {port} (`ss -ltnp 'sport = :{port}'` names it). Give the job a free "
            "MASTER_PORT, or start the ranks with ddpkit run, which picks one."
        )
    if isinstance(result.get("error"), dist.DistNetworkError):
        raise DistributedError(
            f"cannot reach the rendezvous store at {host}:{port} (MASTER_ADDR:MASTER_PORT) "
            f"within {timeout_s:g} s. Check that rank 0 is running and started first, that "
            f"{host} is rank 0's address as seen from this machine, and that no firewall blocks "
            f"port {port}."
        ) from None
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    return result["store"]  # type: ignore[return-value]


def _owner(claim: str) -> str:
    parts = claim.split("|", 1)[0].rsplit(":", 2)
    return f"{parts[0]} pid {parts[1]}" if len(parts) == 3 else repr(claim[:40])


def _duplicate_error(rank: int, claims: str) -> DistributedError:
    return DistributedError(
        f"rank {rank} is claimed by two processes ({claims}). Every process needs its own rank: "
        "check RANK / --node-rank and that the same job was not started twice."
    )


def _refused(store: dist.Store, info: ProcessInfo, why: str) -> DistributedError:
    """The refusal, also left in the store so the ranks that wait can say why one is missing."""
    who = f"{socket.gethostname()} pid {os.getpid()}"
    store.set(f"{PREFIX}/refused/{info.rank}", f"{who}: {why.split('. ')[0]}")
    return DistributedError(f"refused to join as rank {info.rank}: {why}.")


def check_world_size_limit(info: ProcessInfo, environ: dict[str, str] | None = None) -> None:
    """Refuse a world size above ``DDPKIT_MAX_WORLD_SIZE`` (when set).

    Raises:
        ConfigError: the limit is not a positive integer, or the world size exceeds it.
    """
    env = os.environ if environ is None else environ
    raw = env.get(MAX_WORLD_SIZE_ENV, "")
    if not raw:
        return
    if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:
        raise ConfigError(f"invalid {MAX_WORLD_SIZE_ENV}={raw!r}: expected an integer >= 1.")
    if info.world_size > int(raw):
        raise ConfigError(
            f"world size above the limit: world_size={info.world_size}, "
            f"{MAX_WORLD_SIZE_ENV}={raw}. Start fewer processes or raise the limit."
        )


def _job_record(store: dist.Store, info: ProcessInfo, token: bytes | None) -> dict:
    """Record the job (first process) or check this process against it (every later one)."""
    challenge = secrets.token_hex(32)
    mine = json.dumps(
        {
            "world_size": info.world_size,
            "challenge": challenge,
            "verifier": mac(token, challenge, "verify") if token else "",
            "str_hash": str_hash_probe(),
        }
    )
    job = json.loads(store.compare_set(f"{PREFIX}/job", "", mine).decode())
    if job["world_size"] != info.world_size:
        raise _refused(
            store,
            info,
            f"this job has world_size={job['world_size']} but this process has "
            f"world_size={info.world_size}. Start every rank with the same world size",
        )
    if job["verifier"] and token is None:
        raise _refused(
            store,
            info,
            f"this job requires a job token. Set {TOKEN_ENV} or {TOKEN_FILE_ENV} (the same "
            "token on every rank)",
        )
    if token is not None and not job["verifier"]:
        raise _refused(
            store,
            info,
            "this process has a job token but the job was started without one. Give every "
            "rank the same token, or none",
        )
    if token is not None and not same(mac(token, job["challenge"], "verify"), job["verifier"]):
        raise _refused(
            store, info, f"the job token ({TOKEN_ENV}/{TOKEN_FILE_ENV}) does not match this job's"
        )
    return job


def _verify_claims(store: dist.Store, info: ProcessInfo, token: bytes, job: dict) -> None:
    for rank in range(info.world_size):
        claim = store.get(f"{PREFIX}/rank/{rank}").decode()
        who, _, proof = claim.rpartition("|")
        if not same(mac(token, job["challenge"], str(rank), who), proof):
            raise DistributedError(
                f"rendezvous refused: rank {rank}'s claim ({_owner(claim)}) carries no valid "
                f"proof of the job token, so a process without the token tried to join as rank "
                f"{rank}. The job stops before any training collective; check who can reach "
                "the store's port."
            )


def join(
    store: dist.Store,
    info: ProcessInfo,
    timeout_s: float,
    token: bytes | None = None,
    poll_s: float = 0.05,
) -> bool:
    """Claim this rank in ``store`` and wait until all ``world_size`` ranks have joined.

    With a job ``token`` (:mod:`ddpkit.security.token`) a process must prove it holds the job's
    token to be admitted, and every rank verifies every other rank's proof.

    Every rank also compares its :func:`~ddpkit.runtime.hashseed.str_hash_probe` with the
    one in the job record (the first process's) and counts itself in a second counter when they
    differ, *before* it counts itself in: once all have joined, that counter is final. Cost: one
    store read per rank.

    Collective: call on every rank, before ``init_process_group`` with the same store.

    Returns:
        Whether ``hash(str)`` agrees on every rank (see :mod:`ddpkit.runtime.hashseed`).

    Raises:
        DistributedError: another process already claimed this rank (raised on both); fewer
            than ``world_size`` ranks joined within ``timeout_s`` seconds -- the message gives
            how many joined and which ranks are missing; this process's world size or token does
            not match the job's ("refused to join"); a rank's claim lacks a valid token proof.
    """
    job = _job_record(store, info, token)
    me = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    if token is not None:
        me = f"{me}|{mac(token, job['challenge'], str(info.rank), me)}"
    owner = store.compare_set(f"{PREFIX}/rank/{info.rank}", "", me).decode()
    if owner != me:
        claims = f"{_owner(owner)} and {_owner(me)}"
        store.set(f"{PREFIX}/duplicate", f"{info.rank}|{claims}")
        raise _duplicate_error(info.rank, claims)
    if job.get("str_hash", str_hash_probe()) != str_hash_probe():  # older records lack it
        store.add(f"{PREFIX}/str_hash_differs", 1)
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
    if token is not None:
        _verify_claims(store, info, token, job)
    return store.add(f"{PREFIX}/str_hash_differs", 0) == 0


def _who_joined(store: dist.Store, info: ProcessInfo) -> str:
    missing = [r for r in range(info.world_size) if not store.check([f"{PREFIX}/rank/{r}"])]
    joined = info.world_size - len(missing)
    text = f"{joined} of {info.world_size} ranks joined (missing {format_ranks(missing)})"
    refused = [r for r in missing if store.check([f"{PREFIX}/refused/{r}"])]
    notes = [f"rank {r}: refused ({store.get(f'{PREFIX}/refused/{r}').decode()})" for r in refused]
    return "; ".join([text, *notes])
