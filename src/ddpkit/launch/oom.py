"""Was a rank's SIGKILL the kernel's out-of-memory killer? The evidence, the memory, the fix.

torchrun reports a rank the kernel killed for memory as ``exitcode: -9`` and nothing more. When a
rank dies from SIGKILL, the launcher's summary adds one hint line:

- whether it was the out-of-memory killer: the kernel's own line for that pid (``/dev/kmsg``,
  where readable: ``Out of memory: Killed process PID ...``); else the kernel's ``oom_kill``
  counters, read when the job started and again now (``/proc/vmstat`` for the machine; the
  launcher's memory cgroup: ``memory.events`` (v2, its whole subtree) or ``memory.oom_control``
  (v1)): one that rose says it most likely was, counters that did not move say it was not;
- how much memory the rank held (the kernel's line: its resident memory when killed; else the
  job's largest process's peak, ``getrusage``) against the machine's and the cgroup's limit;
- what to do (fewer processes, a smaller batch, ``dmesg``/``journalctl -k`` to confirm).
"""

from __future__ import annotations

import os
import re
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

from ddpkit.diagnostics.disk import format_bytes

VMSTAT = "/proc/vmstat"
CGROUP_ROOT = Path("/sys/fs/cgroup")
KMSG = "/dev/kmsg"
KMSG_SLACK_S = 60.0  # the kernel log's clock against time.monotonic()
_KILLED = re.compile(r"Killed process (?P<pid>\d+) \((?P<name>[^)]*)\)(?P<rest>.*)")
_RSS = re.compile(r"\b(?:anon|file|shmem)-rss:(\d+)kB")
_PREFERENCE = ("memory.events", "memory.oom_control", "vmstat")  # the job's own counter first
_NO_LIMIT = 1 << 60  # cgroup v1's "unlimited" is 2**63 rounded down to a page


def _field(path: str | Path, key: str) -> int | None:
    """The integer after ``key`` in a ``key value`` file (``/proc/vmstat``), else ``None``."""
    try:
        with open(path) as handle:
            for line in handle:
                parts = line.split()
                if len(parts) >= 2 and parts[0] == key:
                    return int(parts[1])
    except (OSError, ValueError):
        return None
    return None


def memory_cgroups(proc_cgroup: str = "/proc/self/cgroup") -> list[Path]:
    """This process's memory cgroup folders: cgroup v1's memory hierarchy, cgroup v2's (at
    ``/sys/fs/cgroup`` or, hybrid, ``/sys/fs/cgroup/unified``); those that exist."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            found.append(CGROUP_ROOT / "memory" / path.lstrip("/"))
        elif controllers == "":
            found += [CGROUP_ROOT / path.lstrip("/"), CGROUP_ROOT / "unified" / path.lstrip("/")]
    names = ("memory.events", "memory.oom_control")
    return [folder for folder in found if any((folder / name).exists() for name in names)]


def oom_kill_counts() -> dict[str, int]:
    """The kernel's out-of-memory kill counters this process can read: file -> count."""
    counts = {}
    candidates = [(VMSTAT, "oom_kill")]
    for folder in memory_cgroups():
        candidates += [(str(folder / "memory.events"), "oom_kill")]
        candidates += [(str(folder / "memory.oom_control"), "oom_kill")]
    for path, key in candidates:
        value = _field(path, key)
        if value is not None:
            counts[path] = value
    return counts


def cgroup_limit(folder: Path) -> int | None:
    """The memory limit of the cgroup ``folder`` in bytes (``None``: none, or unreadable)."""
    for name in ("memory.max", "memory.limit_in_bytes"):
        try:
            text = (folder / name).read_text().strip()
        except OSError:
            continue
        if text != "max" and int(text) < _NO_LIMIT:
            return int(text)
    return None


def machine_memory() -> int | None:
    """``MemTotal`` of ``/proc/meminfo`` in bytes."""
    total = _field("/proc/meminfo", "MemTotal:")
    return None if total is None else total * 1024


def kernel_kill_lines(pid: int, since_s: float) -> tuple[str, str] | None:
    """The kernel's ``Killed process PID`` line for ``pid`` logged after ``since_s``
    (``time.monotonic()``), with its ``oom-kill:`` line (``""`` where absent); ``None`` when
    there is none or ``/dev/kmsg`` cannot be read (not root, ``dmesg_restrict``)."""
    try:
        fd = os.open(KMSG, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    killed = context = ""
    try:
        while True:
            try:
                record = os.read(fd, 8192).decode(errors="replace")
            except BrokenPipeError:  # records overwritten while reading: go on with the next
                continue
            except OSError:  # BlockingIOError: the end of the log
                break
            head, _, text = record.partition(";")
            fields = head.split(",")
            if len(fields) < 3 or int(fields[2]) / 1e6 < since_s - KMSG_SLACK_S:
                continue
            text = text.split("\n", 1)[0]
            if text.startswith("oom-kill:") and f",pid={pid}," in text:
                context = text
            found = _KILLED.search(text)
            if found and int(found["pid"]) == pid:
                killed = text
    finally:
        os.close(fd)
    return (killed, context) if killed else None


@dataclass(frozen=True)
class OomWatch:
    """The kernel's out-of-memory kill counters when the job started, to compare at its end.

    Attributes:
        counts: file -> ``oom_kill`` count (:func:`oom_kill_counts`).
        start_s: ``time.monotonic()`` at the start.
    """

    counts: dict[str, int] = field(default_factory=dict)
    start_s: float = 0.0

    @classmethod
    def start(cls) -> OomWatch:
        return cls(oom_kill_counts(), time.monotonic())

    @property
    def decisive(self) -> str | None:
        """The counter every out-of-memory kill of the job's processes adds to: the launcher's
        cgroup v2 ``memory.events`` (its whole subtree), else the machine's ``/proc/vmstat``
        (cgroup v1's ``memory.oom_control`` misses kills in child cgroups)."""
        events = [path for path in self.counts if path.endswith("memory.events")]
        return events[0] if events else (VMSTAT if VMSTAT in self.counts else None)

    def hints(
        self, exit_codes: dict[int, int], pids: dict[int, int], nproc: int, command: str
    ) -> dict[int, str]:
        """rank -> the hint for each rank that died from SIGKILL (exit status -9)."""
        return {
            rank: sigkill_hint(self, rank, pids.get(rank, 0), nproc=nproc, command=command)
            for rank, code in exit_codes.items()
            if code == -9
        }


OOM_EVIDENCE = "the kernel's out-of-memory killer"  # how a hint with the kernel's evidence begins


def _verdict(watch: OomWatch, rank: int, pid: int, kernel: tuple[str, str] | None) -> str:
    """Whether the out-of-memory killer ended ``rank``, and on what evidence."""
    who = f"rank {rank} (pid {pid})" if pid else f"rank {rank}"
    if kernel is not None:
        said = kernel[0].split(" total-vm")[0]
        return f"{OOM_EVIDENCE} ended {who}; kernel log: '{said}'"
    now = oom_kill_counts()
    decisive = watch.decisive
    if decisive is not None and now.get(decisive) == watch.counts[decisive]:
        return ""  # a counter that every kill of the job's processes counts in did not move
    rose = [(p, n, now[p]) for p, n in watch.counts.items() if now.get(p, n) > n]
    look = f"`dmesg` or `journalctl -k` shows 'Killed process {pid or 'PID'}' if so"
    if rose:
        path, before, after = min(rose, key=lambda r: _PREFERENCE.index(Path(r[0]).name))
        return (
            f"{OOM_EVIDENCE} ran during the job (oom_kill in {path}: "
            f"{before} -> {after}) and most likely ended {who}; {look}"
        )
    return (
        f"{who} died from a SIGKILL that ddpkit did not send: most often the kernel's "
        f"out-of-memory killer; {look}"
    )


def sigkill_hint(watch: OomWatch, rank: int, pid: int, *, nproc: int, command: str) -> str:
    """The hint line for ``rank`` (process ``pid``; 0: unknown), dead from SIGKILL.

    Example:
        >>> watch = OomWatch.start()  # when the job starts
        >>> sigkill_hint(watch, 1, 4242, nproc=2, command="ddpkit run")  # nothing OOM-killed
        "not the kernel's out-of-memory killer (...): something else sent SIGKILL to rank 1 ..."
    """
    kernel = kernel_kill_lines(pid, watch.start_s) if pid else None
    verdict = _verdict(watch, rank, pid, kernel)
    if not verdict:
        path = watch.decisive
        assert path is not None  # _verdict says "" only when the decisive counter did not move
        scope = "this machine" if path == VMSTAT else "the launcher's cgroup"
        return (
            f"not the kernel's out-of-memory killer (oom_kill in {path}, which counts every "
            f"kill on {scope}, stayed at {watch.counts[path]} during the job): "
            f"something else sent SIGKILL to rank {rank}{f' (pid {pid})' if pid else ''}: "
            "`kill -9`, a batch scheduler's time or resource limit, a container runtime."
        )
    return f"{verdict}. {_memory(kernel)}. {_advice(nproc, command)}"


def _memory(kernel: tuple[str, str] | None) -> str:
    """How much the rank held, against the machine's and its cgroup's memory."""
    held = []
    if kernel is not None:
        rss_kib = sum(int(kib) for kib in _RSS.findall(kernel[0]))
        held = [f"it held {format_bytes(rss_kib * 1024)} resident when killed"]
    elif peak := resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024:  # Linux: KiB
        # the largest process the launcher waited for: the workers
        held = [f"the job's largest process peaked at {format_bytes(peak)} resident"]
    found = re.search(r"oom_memcg=([^,]+)", kernel[1]) if kernel else None
    if found:
        folders = [CGROUP_ROOT / sub / found[1].lstrip("/") for sub in ("memory", "unified", "")]
    else:
        folders = memory_cgroups()
    read = [(folder, cgroup_limit(folder)) for folder in folders if folder.exists()]
    limits = [(folder, limit) for folder, limit in read if limit is not None]
    total = machine_memory()
    where = [f"{format_bytes(total)} on this machine"] if total else []
    where += [f"a {format_bytes(limit)} limit on cgroup {folder}" for folder, limit in limits[:1]]
    text = "; ".join([*held, f"memory: {', '.join(where) or 'unknown'}"])
    return text[0].upper() + text[1:]


def _advice(nproc: int, command: str) -> str:
    train = command == "ddpkit train"
    fewer = f"fewer processes ({'--nproc' if train else '-n'} {nproc - 1}), " if nproc > 1 else ""
    batch = "a smaller --batch-size" if train else "a smaller batch per rank"
    return f"Use {fewer}{batch}, or a machine or cgroup with more memory."
