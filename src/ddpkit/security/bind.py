"""Listeners bound to one address, the interface that holds it, and the rules for which address.

torch's TCPStore listens on every interface (``*:PORT``) even when told ``127.0.0.1``, so anyone
who can reach the machine can reach the rendezvous. The libuv TCPStore also accepts a socket the
caller has already bound and put in listening state (``master_listen_fd``): ddpkit binds that
socket to the one chosen address, so the store is reachable there and nowhere else. Gloo's own
listeners bind to the address of ``GLOO_SOCKET_IFNAME``'s interface; ddpkit sets it to the
interface that holds the chosen address.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import os
import socket
import struct

from ddpkit.errors import ConfigError
from ddpkit.log import get_logger

MULTI_NODE_ENV = "DDPKIT_MULTI_NODE"
MASTER_PORT_ENV = "DDPKIT_MASTER_PORT"  # the port the one-node launcher holds for rank 0's store
_SIOCGIFADDR = 0x8915  # from <linux/sockios.h>: get an interface's IPv4 address


def resolve_ipv4(host: str) -> str:
    """``host`` as an IPv4 address (a name is resolved; the first IPv4 answer wins).

    Raises:
        ConfigError: the name does not resolve to an IPv4 address.
    """
    try:
        # An AF_INET sockaddr is (address, port): str() only tells the type checker so.
        return str(socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
    except (socket.gaierror, IndexError):
        raise ConfigError(
            f"cannot resolve address: host={host!r} has no IPv4 address. Give an IPv4 address "
            "or a name this machine can resolve."
        ) from None


def listening_socket(host: str, port: int, backlog: int = 1024) -> socket.socket:
    """A TCP socket bound to ``host``'s address only and listening (``port`` 0: the OS picks).

    Raises:
        ConfigError: the port is already in use on that address, or the address is not one of
            this machine's.
    """
    address = resolve_ipv4(host)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers only
        sock.bind((address, port))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"cannot start the rendezvous store: port {port} on {host} is already in use. "
                "Pick another free port (MASTER_PORT, or the port of --rdzv-endpoint); on one "
                "node `ddpkit run` lets the system pick one."
            ) from None
        raise ConfigError(
            f"cannot listen on {host}:{port} ({address}): {exc.strerror}. The store's address "
            "must be one of this machine's (rank 0 / the first node serves the store)."
        ) from None
    return sock


def reserve_port(host: str) -> socket.socket:
    """A socket bound to a free port on ``host``'s address and never listening: the port stays
    this process's until the socket is closed, yet a rank can still listen on it.

    Linux semantics (measured on this kernel, and what ``inet_csk_bind_conflict`` says): while a
    socket with ``SO_REUSEADDR`` is bound to the port but not listening, another
    ``SO_REUSEADDR`` socket may bind it and listen (the rank's store; TCPStore and libuv set
    that option), one at a time; a bind to port 0 and a ``connect`` never pick it. A port
    picked and released instead (torch's ``get_free_port``) can be taken by anything in between.

    Not a collective.

    Raises:
        ConfigError: ``host`` does not resolve to an IPv4 address.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((resolve_ipv4(host), 0))
    return sock


def interface_of(address: str) -> str | None:
    """The name of the network interface holding IPv4 ``address`` (``"lo"`` for 127.0.0.1).

    Returns ``None`` when no interface of this machine has it.
    """
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on this interface
                continue
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    finally:
        probe.close()
    if ipaddress.ip_address(address).is_loopback:  # 127.0.0.2 etc. live on lo as well
        return "lo"
    return None


def local_address_towards(host: str, port: int) -> str:
    """The address this machine uses to reach ``host:port`` (a UDP ``connect``: no packet sent).

    This is the address to advertise to the other nodes, also when this machine's hostname
    resolves to 127.0.0.1 (a common /etc/hosts default that breaks multi-node rendezvous).
    """
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((resolve_ipv4(host), port))
        return probe.getsockname()[0]
    finally:
        probe.close()


def check_store_address(host: str, multi_node: bool) -> str:
    """Apply the address rules to the store's ``host``; returns its IPv4 address.

    The unspecified address (0.0.0.0: every interface) is always refused. A single-node job
    must use a loopback address, so nothing outside this machine can reach it. A non-loopback
    address is allowed only for several nodes (``multi_node``: ``ddpkit run --nnodes``, or a
    world size above the local world size as torchrun and Slurm set it; or
    ``DDPKIT_MULTI_NODE=1``); a public address then gets a warning.

    Raises:
        ConfigError: the unspecified address; a non-loopback address for a single-node job.
    """
    address = resolve_ipv4(host)
    ip = ipaddress.ip_address(address)
    if ip.is_unspecified:
        raise ConfigError(
            f"refusing to listen on every interface: {host} ({address}) is the unspecified "
            "address. Give the one address of this machine the other nodes use, e.g. "
            "10.0.0.1, or 127.0.0.1 for one node."
        )
    multi_node = multi_node or os.environ.get(MULTI_NODE_ENV) == "1"
    if not ip.is_loopback and not multi_node:
        raise ConfigError(
            f"refusing to listen on a non-loopback address for a single-node job: "
            f"MASTER_ADDR={host} ({address}). Use 127.0.0.1, or ask for several nodes "
            f"explicitly (ddpkit run --nnodes N, or {MULTI_NODE_ENV}=1)."
        )
    if ip.is_global:
        get_logger("security").warning(
            "the rendezvous store listens on the public address %s: anyone who can reach it "
            "can disturb the job. Prefer a private network, a firewall, and a job token.",
            address,
        )
    return address
