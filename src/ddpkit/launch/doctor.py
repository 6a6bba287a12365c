"""``ddpkit doctor``: an environment report for bug reports, then live checks.

Every check returns a :class:`Check`; ``ok=False`` fails the doctor run (exit 1), ``ok=None`` is
a warning or a skipped check. Checks only contact loopback or the address the user names.
"""

from __future__ import annotations

import os
import platform
import resource
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass

ENV_PREFIXES = ("MASTER_", "NCCL_", "GLOO_", "TORCH_DISTRIBUTED", "TORCHELASTIC_", "DDPKIT_")
ENV_NAMES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_NODEID",
)
MIN_SHM_BYTES = 512 * 2**20  # DataLoader workers pass batches through /dev/shm
MIN_OPEN_FILES = 4096  # each rank holds a socket per peer and per store connection


@dataclass
class Check:
    """One live check: ``name``, ``ok`` (True, False = failure, None = warning/skipped), detail."""

    name: str
    ok: bool | None
    detail: str


def environment_report() -> dict:
    """Versions, devices, backends, network interfaces and the relevant environment variables."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda_available": cuda,
        "cuda_version": torch.version.cuda,
        "nccl_version": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "cpu_count": os.cpu_count(),
        "backends": {
            name: bool(getattr(dist, f"is_{name}_available")())
            for name in ("gloo", "nccl", "mpi", "ucc")
            if hasattr(dist, f"is_{name}_available")
        },
        "network_interfaces": [name for _, name in socket.if_nameindex()],
        "hostname": socket.gethostname(),
        "env": {
            key: value
            for key, value in sorted(os.environ.items())
            if key in ENV_NAMES or key.startswith(ENV_PREFIXES)
        },
    }


def _loopback_rank(runtime) -> float:
    from ddpkit.runtime.collectives import all_reduce_sum

    return all_reduce_sum([runtime.rank + 1.0], runtime).item()


def check_loopback_allreduce() -> Check:
    """Two spawned gloo processes all-reduce over loopback (rendezvous through a FileStore)."""
    from ddpkit.errors import DistributedError
    from ddpkit.launch.spawn import DistributedTestError, run_distributed
    from ddpkit.runtime.rendezvous import check_local_route

    try:
        check_local_route("127.0.0.1")  # lo down: the fix, not gloo's "Unable to find interface"
    except DistributedError as exc:
        return Check("loopback_allreduce", False, str(exc))
    try:
        results = run_distributed(_loopback_rank, 2, timeout_s=60, pg_timeout_s=30)
    except DistributedTestError as exc:
        return Check("loopback_allreduce", False, str(exc).splitlines()[-1][:300])
    ok = results == [3.0, 3.0]
    return Check("loopback_allreduce", ok, f"2 gloo ranks summed 1 + 2 = {results[0]:g}")


def check_port_free(port: int, host: str = "127.0.0.1") -> Check:
    """Whether ``host:port`` can be bound (a rendezvous store would listen there)."""
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            return Check(
                "port_free",
                False,
                f"{host}:{port} is in use ({exc.strerror}): pick "
                "another --port, or let ddpkit run pick one (it binds port 0)",
            )
    return Check("port_free", True, f"{host}:{port} is free")


def check_reachable(address: str, timeout_s: float = 3.0) -> Check:
    """Whether a TCP connection to ``HOST:PORT`` (the master's store) opens."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as exc:
        return Check(
            "master_reachable",
            False,
            f"cannot connect to {address}: {exc}. Check that "
            "rank 0 is running, the address and port, and firewalls between the nodes",
        )
    return Check("master_reachable", True, f"connected to {address}")


def check_shm() -> Check:
    try:
        stats = os.statvfs("/dev/shm")
    except OSError:
        return Check("shared_memory", None, "/dev/shm not found")
    free = stats.f_bavail * stats.f_frsize
    ok = True if free >= MIN_SHM_BYTES else None
    hint = "" if ok else " (small: DataLoader workers may fail; docker: --shm-size=8g)"
    return Check("shared_memory", ok, f"/dev/shm has {free / 2**30:.1f} GiB free{hint}")


def check_open_files() -> Check:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ok = True if soft >= MIN_OPEN_FILES or soft == resource.RLIM_INFINITY else None
    hint = "" if ok else f" (low for many ranks: ulimit -n {min(hard, 65536)})"
    return Check("open_file_limit", ok, f"soft {soft}, hard {hard}{hint}")


# The first release of each supported branch with CPython's fix for gh-112275 (a child forked
# while another thread creates its Python thread state waits forever on the interpreter's
# thread-list lock): the release notes of 3.10.15 and 3.11.10; 3.12 is not affected.
FORK_FIXED_IN = {(3, 10): (3, 10, 15), (3, 11): (3, 11, 10)}


def check_python_fork(version: tuple[int, ...] | None = None) -> Check:
    """Whether this Python has CPython's fix for the fork deadlock gh-112275 (a warning if not).

    Without it, a process forked while another thread enters Python for the first time (gloo's
    and NCCL's threads do, when they drop a tensor that Python owns) can hang in ``os.fork()``
    for good: a DataLoader worker (Linux's default start method is ``fork``) that never starts,
    so its rank waits for its first batch. Not a collective; starts no process.

    Args:
        version: (major, minor, micro); this interpreter's when ``None``.
    """
    version = tuple(version or sys.version_info[:3])
    text = ".".join(map(str, version))
    fixed = FORK_FIXED_IN.get((version[0], version[1]))
    if fixed is None or version >= fixed:
        return Check(
            "python_fork", True, f"Python {text} has CPython's fix for the fork deadlock gh-112275"
        )
    return Check(
        "python_fork",
        None,
        f"Python {text}: a DataLoader worker (or any process) forked while a gloo or NCCL thread "
        "enters Python can hang for good at its start (CPython gh-112275), and its rank with it; "
        f"upgrade to Python {'.'.join(map(str, fixed))} or later, or pass "
        "multiprocessing_context='forkserver' to the DataLoader",
    )


TLS_PROBE = """
import datetime, os, tempfile, torch.distributed as dist
path = os.path.join(tempfile.mkdtemp(), "store")
dist.init_process_group("gloo", store=dist.FileStore(path, 1), rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=10))
dist.destroy_process_group()
"""


def check_gloo_tls() -> Check:
    """Whether this torch build's gloo has its TLS transport (``GLOO_DEVICE_TRANSPORT=TCP_TLS``)."""
    env = {**os.environ, "GLOO_DEVICE_TRANSPORT": "TCP_TLS"}
    proc = subprocess.run(
        [sys.executable, "-c", TLS_PROBE], env=env, capture_output=True, text=True, timeout=60
    )
    if proc.returncode == 0:
        return Check("gloo_tls", True, "gloo TLS transport available")
    return Check(
        "gloo_tls",
        None,
        'gloo TLS transport not in this torch build ("unsupported '
        'gloo device"): traffic between nodes is unencrypted; use an encrypted network '
        "layer such as WireGuard or IPsec between nodes",
    )


def run_checks(port: int | None = None, master: str | None = None) -> list[Check]:
    checks = [
        check_loopback_allreduce(),
        check_python_fork(),
        check_shm(),
        check_open_files(),
        check_gloo_tls(),
    ]
    if port is not None:
        checks.append(check_port_free(port))
    if master is not None:
        checks.append(check_reachable(master))
    return checks


def report_as_dict(env: dict, checks: list[Check]) -> dict:
    return {"environment": env, "checks": [asdict(c) for c in checks]}
