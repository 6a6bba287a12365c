"""A real single-node Slurm for the tests: Debian's slurm-wlm and munge, run as daemons.

:func:`ensure_installed` installs the two packages where they are missing (root, apt-get and a
reachable Debian mirror needed) and :meth:`SlurmCluster.start` brings up munged, slurmctld and
slurmd with a generated slurm.conf. Everything the cluster writes lives in one scratch folder
(/etc is untouched), and the daemons and every client command (srun, sbatch, scontrol, ...) run
inside a network namespace made for the cluster, reached with ``nsenter``:

- slurm-wlm 22.05's daemons listen on 0.0.0.0 (there is no option to bind one address); in the
  namespace nothing outside the machine, or outside the namespace, can reach them, and Slurm's
  usual ports 6817/6818 collide with no other cluster (another pytest worker's, another
  checkout's). Traffic goes over the namespace's loopback: ``SlurmctldHost=host(127.0.0.1)``,
  ``NodeAddr=127.0.0.1``.
- The namespace also holds one veth pair with a private address that nothing ever contacts:
  slurmctld looks up its listen address with ``AI_ADDRCONFIG``, which finds none while the only
  interface is loopback ("Unable to resolve (null)").
- ``MpiParams=ports=...``: srun reserves ports for every step (``SLURM_STEP_RESV_PORTS``) and
  ddpkit takes the first as ``MASTER_PORT``, so concurrent steps never share a port.

Waits are on conditions with deadlines (munge answers, sinfo says idle, a job's state), never a
fixed sleep. :meth:`SlurmCluster.stop` cancels the jobs, stops the daemons by the PIDs in their
pid files (SIGTERM, SIGKILL after a deadline), kills whatever else still runs in the namespace
(only this cluster's processes enter it), deletes the namespace and the folder.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers import Completed, pid_alive

PACKAGES = ("slurm-wlm", "munge")
COMMANDS = ("munged", "mungekey", "munge", "unmunge", "slurmctld", "slurmd", "srun", "sbatch")
COMMANDS += ("scontrol", "scancel", "sinfo", "squeue")
SBIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
INSTALL_LOCK = Path(tempfile.gettempdir()) / "ddpkit-slurm-install.lock"
VETH_ADDRESS = "10.254.254.1/30"  # inside the cluster's own namespace only; never contacted
RESERVED_PORTS = "20000-20999"  # MpiParams=ports: srun reserves a few per step


class SlurmUnavailable(Exception):
    """Slurm cannot be installed or started here; the message is the skip reason."""


def _which(name: str) -> str | None:
    return shutil.which(name, path=f"{os.environ.get('PATH', '')}:{SBIN_PATH}")


def _tail(text: str, lines: int = 6) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


def _apt(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "PATH": SBIN_PATH}
    lock = ["-o", f"DPkg::Lock::Timeout={int(timeout_s)}"]  # another apt-get on the machine
    try:
        return subprocess.run(
            ["apt-get", *lock, *args], capture_output=True, text=True, timeout=timeout_s, env=env
        )
    except subprocess.TimeoutExpired:
        raise SlurmUnavailable(
            f"apt-get {args[0]} did not finish within {timeout_s:g} s (no network, or a slow "
            "mirror): cannot install slurm-wlm and munge"
        ) from None


def ensure_installed(timeout_s: float = 300.0) -> float:
    """Install slurm-wlm and munge with apt-get where a command of theirs is missing.

    Returns:
        The seconds spent installing (0.0 when everything was there).

    Raises:
        SlurmUnavailable: not root, no apt-get, ``ip``/``nsenter`` missing, or the update or
            install failed or ran past ``timeout_s``; the message says which.
    """
    for tool in ("ip", "nsenter"):
        if _which(tool) is None:
            raise SlurmUnavailable(f"the Slurm tests need the {tool} command (iproute2/util-linux)")
    if all(_which(name) for name in COMMANDS):
        return 0.0
    missing = ", ".join(name for name in COMMANDS if not _which(name))
    if os.geteuid() != 0:
        raise SlurmUnavailable(
            f"Slurm is not installed ({missing} missing) and installing it "
            "needs root: apt-get install slurm-wlm munge"
        )
    if _which("apt-get") is None:
        raise SlurmUnavailable(
            f"Slurm is not installed ({missing} missing) and there is no "
            "apt-get to install slurm-wlm and munge with"
        )
    start = time.monotonic()
    INSTALL_LOCK.touch()
    with INSTALL_LOCK.open() as lock:  # one installer at a time (pytest workers, checkouts)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if all(_which(name) for name in COMMANDS):  # the other installer did it
            return time.monotonic() - start
        update = _apt(["update"], timeout_s)
        if update.returncode != 0:
            raise SlurmUnavailable(f"apt-get update failed (no network?): {_tail(update.stderr)}")
        install = _apt(["install", "-y", "--no-install-recommends", *PACKAGES], timeout_s)
        if install.returncode != 0:
            why = _tail(install.stderr or install.stdout)
            raise SlurmUnavailable(f"apt-get install {' '.join(PACKAGES)} failed: {why}")
    if not all(_which(name) for name in COMMANDS):
        missing = ", ".join(name for name in COMMANDS if not _which(name))
        raise SlurmUnavailable(f"installed {' '.join(PACKAGES)} but {missing} still missing")
    return time.monotonic() - start


SLURM_CONF = """\
ClusterName=ddpkit-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={base}/munge/munge.sock,cred_expire=10
SlurmUser=root
SlurmdUser=root
StateSaveLocation={base}/state
SlurmdSpoolDir={base}/spool
SlurmctldPidFile={base}/run/slurmctld.pid
SlurmdPidFile={base}/run/slurmd.pid
SlurmctldLogFile={base}/log/slurmctld.log
SlurmdLogFile={base}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
MpiParams=ports={ports}
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MailProg=/bin/true
KillWait=5
InactiveLimit=0
SlurmdParameters=config_overrides
NodeName={host} NodeAddr=127.0.0.1 NodeHostname={host} CPUs=8 Boards=1 SocketsPerBoard=1 \
CoresPerSocket=8 ThreadsPerCore=1 RealMemory={memory_mib} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""
# cred_expire=10 and sched_interval=1: a requeued job starts again after ~11 s (~170 s with the
# defaults). CPUs=8 with config_overrides: several 2-task jobs at once on a 2-core machine.


@dataclass
class SlurmCluster:
    """One running single-node cluster; :meth:`start` builds it, :meth:`stop` removes it.

    Attributes:
        base: the scratch folder (config, munge key and socket, state, spool, logs).
        netns: the network namespace the daemons and the client commands run in.
        start_s: seconds from starting munged to sinfo showing the node idle.
        install_s: seconds :func:`ensure_installed` spent (0.0: it was installed).
    """

    base: Path
    netns: str
    host: str
    start_s: float = 0.0
    install_s: float = 0.0
    _netns_made: bool = field(default=False, repr=False)

    @property
    def conf(self) -> Path:
        return self.base / "slurm.conf"

    @classmethod
    def start(cls, timeout_s: float = 30.0) -> SlurmCluster:
        """Bring up munged, slurmctld and slurmd; wait until the node is idle.

        Raises:
            SlurmUnavailable: a step failed (namespace, munge, a daemon); the message has the
                command's error or the daemon's last log lines. What started is stopped.
        """
        base = Path(tempfile.mkdtemp(prefix="ddpkit-slurm-"))  # short: the munge socket path
        cluster = cls(base, f"ddpkit-slurm-{uuid.uuid4().hex[:8]}", os.uname().nodename)
        cluster.host = cluster.host.split(".")[0]
        try:
            cluster._make_netns()
            began = time.monotonic()
            cluster._start_munge(began + timeout_s)
            cluster._start_slurm(began + timeout_s)
            cluster.start_s = time.monotonic() - began
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _ip(self, *args: str) -> None:
        done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise SlurmUnavailable(f"ip {' '.join(args)} failed: {done.stderr.strip()}")

    def _make_netns(self) -> None:
        self._ip("netns", "add", self.netns)
        self._netns_made = True
        self._ip("-n", self.netns, "link", "set", "lo", "up")
        self._ip("-n", self.netns, "link", "add", "dks0", "type", "veth", "peer", "name", "dks1")
        self._ip("-n", self.netns, "addr", "add", VETH_ADDRESS, "dev", "dks0")
        for name in ("dks0", "dks1"):
            self._ip("-n", self.netns, "link", "set", name, "up")

    def _start_munge(self, deadline: float) -> None:
        munge = self.base / "munge"
        for name in ("munge", "state", "spool", "run", "log"):
            (self.base / name).mkdir(mode=0o700)
        for folder in (self.base, munge):  # clients need x on the socket's folders
            folder.chmod(0o711)
        self._daemon(["mungekey", "-c", "-k", str(munge / "munge.key")], "mungekey")
        (munge / "munge.key").chmod(0o400)
        self._daemon(
            [
                "munged",
                "--force",
                f"--socket={munge}/munge.sock",
                f"--key-file={munge}/munge.key",
                f"--pid-file={munge}/munged.pid",
                f"--log-file={munge}/munged.log",
                f"--seed-file={munge}/munge.seed",
            ],
            "munged",
        )
        self._wait(deadline, "munged answering", self._munge_answers, munge / "munged.log")

    def _munge_answers(self) -> bool:
        sock = f"--socket={self.base}/munge/munge.sock"
        cred = subprocess.run(["munge", sock, "-n"], capture_output=True, timeout=10)
        if cred.returncode != 0:
            return False
        return (
            subprocess.run(
                ["unmunge", sock], input=cred.stdout, capture_output=True, timeout=10
            ).returncode
            == 0
        )

    def _start_slurm(self, deadline: float) -> None:
        self.conf.write_text(
            SLURM_CONF.format(
                host=self.host, base=self.base, ports=RESERVED_PORTS, memory_mib=_memory_mib()
            )
        )
        self._daemon(self._in_netns(["slurmctld", "-f", str(self.conf)]), "slurmctld")
        self._daemon(self._in_netns(["slurmd", "-f", str(self.conf)]), "slurmd")
        self._wait(deadline, "the node idle in sinfo", self._node_idle, self.base / "log")

    def _node_idle(self) -> bool:
        done = self.run(["sinfo", "-h", "-o", "%t"], timeout_s=10, check=False)
        return done.returncode == 0 and done.stdout.strip() == "idle"

    def _daemon(self, argv: list[str], name: str) -> None:
        """Run a command that daemonizes (or just finishes); it must exit 0."""
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=self.env())
        if done.returncode != 0:
            raise SlurmUnavailable(f"{name} failed to start: {_tail(done.stderr + done.stdout)}")

    def _wait(self, deadline: float, what: str, ready, logs: Path) -> None:
        while not ready():
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"no {what} within the deadline; {self._log_tail(logs)}")
            time.sleep(0.05)

    def _log_tail(self, logs: Path) -> str:
        files = sorted(logs.glob("*.log")) if logs.is_dir() else [logs]
        tails = [
            f"{f.name}: {_tail(f.read_text(errors='replace'), 3)}" for f in files if f.is_file()
        ]
        return "; ".join(tails) or "no log written"

    def _in_netns(self, argv: list[str]) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.netns}", *argv]

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of a client command: this cluster's SLURM_CONF, sbin on PATH."""
        path = f"{os.environ.get('PATH', '')}:{SBIN_PATH}"
        return {**os.environ, "SLURM_CONF": str(self.conf), "PATH": path, **(extra or {})}

    def popen(self, argv: list[str], *, cwd: Path | None = None, env: dict | None = None):
        """Start ``argv`` (srun, sbatch, ...) in the namespace, in a session of its own."""
        return subprocess.Popen(
            self._in_netns(argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=cwd,
            env=self.env(env),
            start_new_session=True,
        )

    def run(
        self,
        argv: list[str],
        *,
        timeout_s: float = 120,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
        check: bool = True,
    ) -> Completed:
        """Run ``argv`` in the namespace; on timeout kill its process group and raise.

        Raises:
            TimeoutError: still running after ``timeout_s`` (its output in the message).
            RuntimeError: ``check`` and it exited non-zero.
        """
        proc = self.popen(argv, cwd=cwd, env=env)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise TimeoutError(f"{argv} ran past {timeout_s:g} s\n{out}\n{err}") from None
        if check and proc.returncode != 0:
            raise RuntimeError(f"{argv} exited {proc.returncode}\n{out}\n{err}")
        return Completed(proc.returncode, out, err)

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, ExitCode, ...); {} once purged."""
        done = self.run(["scontrol", "-o", "show", "job", job_id], timeout_s=10, check=False)
        return dict(re.findall(r"(\w+)=(\S*)", done.stdout)) if done.returncode == 0 else {}

    def stop(self) -> None:
        """Cancel every job, stop the daemons, remove the namespace and the folder.

        Safe to call on a half-started cluster and more than once.
        """
        if (self.base / "run" / "slurmctld.pid").is_file():
            self._cancel_jobs(deadline=time.monotonic() + 20)
        for pid_file in ("run/slurmd.pid", "run/slurmctld.pid", "munge/munged.pid"):
            self._stop_daemon(self.base / pid_file)
        if self._netns_made:
            self._kill_netns_leftovers()
            subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, timeout=30)
            self._netns_made = False
        shutil.rmtree(self.base, ignore_errors=True)

    def _cancel_jobs(self, deadline: float) -> None:
        """slurmstepd outlives slurmd: end the jobs through Slurm first."""
        self.run(["scancel", "--user=root"], timeout_s=10, check=False)
        while time.monotonic() < deadline:
            queue = self.run(["squeue", "-h", "-o", "%i"], timeout_s=10, check=False)
            if queue.returncode != 0 or not queue.stdout.strip():
                return
            time.sleep(0.2)

    def _stop_daemon(self, pid_file: Path, timeout_s: float = 15.0) -> None:
        """SIGTERM the daemon of ``pid_file`` (if it is still this cluster's), SIGKILL later."""
        try:
            pid = int(pid_file.read_text().split()[0])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            return
        if str(self.base).encode() not in cmdline:  # gone, and its pid reused: not ours
            return
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)

    def _kill_netns_leftovers(self) -> None:
        """Only this cluster's processes ever enter its namespace: none may outlive it."""
        found = subprocess.run(
            ["ip", "netns", "pids", self.netns], capture_output=True, text=True, timeout=30
        )
        for pid in (int(p) for p in found.stdout.split()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _memory_mib() -> int:
    """The node's RealMemory: a little below the machine's (slurmd refuses more than it has)."""
    with open("/proc/meminfo") as handle:
        total_kib = int(handle.readline().split()[1])
    return int(total_kib / 1024 * 0.9)
