"""Network namespaces for multi-node tests: N "nodes" on one private switch, removed afterwards.

Each node is a namespace with a veth pair whose other end sits on a bridge inside a "switch"
namespace, so the nodes reach each other at private addresses that exist only there. Every
process of a test must run inside a node's namespace (``ip netns exec``): from the host namespace
those addresses would route off the machine. Needs root and ``ip``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


class NamespacesUnavailable(RuntimeError):
    """This machine does not allow network namespaces (the reason is the message)."""


@dataclass(frozen=True)
class Node:
    """One namespace: its name, its address on the switch, and the interface holding it."""

    ns: str
    address: str
    ifname: str


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _delete(namespaces: list[str], links: list[str]) -> None:
    for ns in namespaces:  # deleting a namespace deletes its ends of the veth pairs
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
    for link in links:  # a pair that never left the host namespace (a failed set-up)
        subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=30)


@contextmanager
def switched_nodes(num_nodes: int) -> Iterator[list[Node]]:
    """``num_nodes`` namespaces on one bridge (``10.232.X.1 ..``), deleted on exit.

    Raises:
        NamespacesUnavailable: not root, no ``ip``, or the kernel refuses namespaces, veth or
            bridges.
    """
    if os.geteuid() != 0 or shutil.which("ip") is None:
        raise NamespacesUnavailable("network namespaces need root and the ip command")
    tag = uuid.uuid4().hex[:6]
    subnet = f"10.232.{int(tag[:2], 16)}"
    switch = f"ddpk-{tag}-sw"
    nodes = [Node(f"ddpk-{tag}-{i}", f"{subnet}.{i + 1}", f"dk{tag}n{i}") for i in range(num_nodes)]
    created: list[str] = []
    links: list[str] = []
    try:
        for ns in (switch, *(node.ns for node in nodes)):
            ip("netns", "add", ns)
            created.append(ns)
        ip("-n", switch, "link", "add", "br0", "type", "bridge")
        ip("-n", switch, "link", "set", "br0", "up")
        for i, node in enumerate(nodes):
            port = f"dk{tag}s{i}"
            ip("link", "add", node.ifname, "type", "veth", "peer", "name", port)
            links.append(node.ifname)
            ip("link", "set", node.ifname, "netns", node.ns)
            ip("link", "set", port, "netns", switch)
            ip("-n", switch, "link", "set", port, "master", "br0")
            ip("-n", switch, "link", "set", port, "up")
            ip("-n", node.ns, "addr", "add", f"{node.address}/24", "dev", node.ifname)
            ip("-n", node.ns, "link", "set", node.ifname, "up")
            ip("-n", node.ns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as exc:
        _delete(created, links)
        raise NamespacesUnavailable(f"cannot build the namespaces: {exc.stderr.strip()}") from None
    try:
        yield nodes
    finally:
        for node in nodes:
            kill_node(node)
        _delete(created, links)


def start_in(node: Node, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python ARGV`` inside ``node``'s namespace, its output (both streams) in one pipe."""
    return subprocess.Popen(
        ["ip", "netns", "exec", node.ns, sys.executable, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def node_pids(node: Node) -> list[int]:
    """Every process inside ``node``'s namespace."""
    found = subprocess.run(
        ["ip", "netns", "pids", node.ns], capture_output=True, text=True, timeout=30
    )
    return [int(pid) for pid in found.stdout.split()]


def kill_node(node: Node) -> list[int]:
    """SIGKILL every process inside ``node``'s namespace (a node lost); returns their pids."""
    pids = node_pids(node)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def finish(procs: list[subprocess.Popen], timeout_s: float) -> list[tuple[int | None, str]]:
    """Wait for every process; kill the ones still running at the deadline (code ``None``)."""
    deadline = time.monotonic() + timeout_s
    results = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            results.append((proc.returncode, out))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            results.append((None, out))
    return results


def listeners(node: Node) -> list[str]:
    """The local addresses of every listening TCP socket inside ``node``'s namespace."""
    found = subprocess.run(
        ["ip", "netns", "exec", node.ns, "ss", "-Hltn"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return [line.split()[3] for line in found.stdout.splitlines() if line.strip()]
