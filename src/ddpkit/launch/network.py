"""Where a ``ddpkit run`` job listens and what it advertises: the network plan, the rendezvous
store the launcher hosts on one address only, and gloo's TLS variables (see docs/security.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

from ddpkit.errors import ConfigError
from ddpkit.security.bind import (
    check_store_address,
    interface_of,
    listening_socket,
    local_address_towards,
)

if TYPE_CHECKING:  # the launcher imports this module
    from ddpkit.launch.launcher import LaunchSpec


@dataclass(frozen=True)
class NetworkPlan:
    """Where this node's listeners bind and what it advertises.

    Attributes:
        store_address: the address this node's launcher hosts the rendezvous store on, or
            ``None`` when another node hosts it.
        endpoint_host, endpoint_port: the rendezvous store (port 0: picked when hosted).
        local_address: the address this node advertises to the others (its workers' gloo
            listeners and, on the node of rank 0, the job's store bind to it).
        ifname: the interface holding ``local_address`` (``GLOO_SOCKET_IFNAME``).
    """

    store_address: str | None
    endpoint_host: str
    endpoint_port: int
    local_address: str
    ifname: str


def plan_network(spec: LaunchSpec) -> NetworkPlan:
    """Work out the addresses a user would otherwise set by hand.

    One node: everything on 127.0.0.1 / ``lo``. Several nodes: node 0 hosts the store on the
    endpoint's address (which must be one of its own); every node advertises the address it
    uses to reach the endpoint (so a hostname resolving to 127.0.0.1 does no harm) and pins
    gloo to the interface that holds it.

    Raises:
        ConfigError: node 0 does not own the endpoint address; no interface holds the address
            this node would advertise.
    """
    if spec.nnodes == 1:
        return NetworkPlan("127.0.0.1", "127.0.0.1", 0, "127.0.0.1", "lo")
    assert spec.rdzv_endpoint is not None  # validate_spec: several nodes need an endpoint
    host, _, port = spec.rdzv_endpoint.rpartition(":")
    address = check_store_address(host, multi_node=True)
    if spec.node_rank == 0 and interface_of(address) is None:
        raise ConfigError(
            f"node rank 0 hosts the rendezvous store, but --rdzv-endpoint {host} ({address}) is "
            "not an address of this machine. Run node rank 0 on that host, or give one of its "
            "addresses."
        )
    local = address if spec.node_rank == 0 else local_address_towards(address, int(port))
    ifname = interface_of(local)
    if ifname is None:
        raise ConfigError(
            f"no network interface holds {local}, the address this node uses to reach {host}. "
            "Check the routing to the rendezvous endpoint."
        )
    return NetworkPlan(address if spec.node_rank == 0 else None, address, int(port), local, ifname)


def tls_environment(spec: LaunchSpec) -> dict[str, str]:
    """The gloo variables that turn its TLS transport on, after checking this build has it.

    Raises:
        ConfigError: TLS files given, but this torch build's gloo has no TLS transport.
    """
    if spec.tls is None:
        return {}
    from ddpkit.launch.doctor import check_gloo_tls

    if not check_gloo_tls().ok:
        raise ConfigError(
            "cannot encrypt: --tls-cert/--tls-key/--tls-ca given, but this torch build's gloo "
            'has no TLS transport ("unsupported gloo device"; the stock Linux wheels lack it). '
            "Use an encrypted network layer between nodes (WireGuard or IPsec) and drop the "
            "--tls-* flags, or use a torch built with gloo TLS."
        )
    cert, key, ca = spec.tls
    return {
        "GLOO_DEVICE_TRANSPORT": "TCP_TLS",
        "GLOO_DEVICE_TRANSPORT_TCP_TLS_CERT": cert,
        "GLOO_DEVICE_TRANSPORT_TCP_TLS_PKEY": key,
        "GLOO_DEVICE_TRANSPORT_TCP_TLS_CA_FILE": ca,
    }


def host_rendezvous_store(address: str, port: int = 0) -> dist.TCPStore:
    """A TCPStore for torchrun's c10d rendezvous, listening on ``address`` only (port 0: the OS
    picks one).

    Raises:
        ConfigError: ``address`` is not one of this machine's; the port is in use.
    """
    listener = listening_socket(address, port)
    port = listener.getsockname()[1]
    return dist.TCPStore(
        address,
        port,
        is_master=True,
        wait_for_workers=False,
        multi_tenant=True,
        master_listen_fd=listener.detach(),
        use_libuv=True,
    )
