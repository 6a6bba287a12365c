"""What the test suite spends the CPU on: busy and idle core-seconds, and the interpreters that
import torch.

    python bench/suite_cost.py                      # the whole suite, as scripts/test.sh runs it
    python bench/suite_cost.py -- -m "not slow"     # arguments after -- go to scripts/test.sh
    DDPKIT_TEST_WORKERS=2 python bench/suite_cost.py

Runs ``bash scripts/test.sh`` once and reports: its wall time; the machine's busy and idle
core-seconds over that time (``/proc/stat``, all processes: the measurement assumes nothing
else runs); how many Python processes imported ``torch`` and how many also imported
``torch._dynamo`` (DDP's constructor does, through ``torch._dynamo.utils``); and, from the
median CPU time of importing each in a fresh interpreter here, the import floor: the
core-seconds the suite spends on those imports before any test work. The count comes from a
``sitecustomize`` module put first on ``PYTHONPATH`` for the run, which appends one line per
first import to a log; processes forked from a forkserver that preloaded torch import nothing
and are not counted, which is the point of the forkserver (``ddpkit.testing``). A process
whose environment drops ``PYTHONPATH`` is not counted either: the floor is a lower bound.
Linux only.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WATCHED = ("torch", "torch._dynamo")
SITECUSTOMIZE = """
import os, sys
_LOG = {log!r}
_seen = set()
class _FirstImport:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name in {watched!r} and name not in _seen:
            _seen.add(name)
            with open(_LOG, "a") as handle:
                handle.write(f"{{os.getpid()}} {{name}}\\n")
        return None
sys.meta_path.insert(0, _FirstImport)
"""


def _busy_idle_ticks() -> tuple[int, int]:
    """(busy, idle) jiffies of all CPUs since boot (``/proc/stat``'s first line)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    return user + nice + system + irq + softirq + steal, idle + iowait


def _import_cpu_s(statement: str, python: str, repeats: int) -> float:
    """Median CPU seconds (user + system) of a fresh interpreter that runs ``statement``."""
    samples = []
    for _ in range(repeats):
        before = os.times()
        subprocess.run([python, "-c", statement], check=True)
        after = os.times()
        samples.append(
            after.children_user
            - before.children_user
            + after.children_system
            - before.children_system
        )
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="import timings (default 5)")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to scripts/test.sh")
    args = parser.parse_args(argv)
    python = str(REPO / ".venv" / "bin" / "python")
    with tempfile.TemporaryDirectory(prefix="ddpkit-suite-cost-") as scratch:
        log = Path(scratch) / "imports.log"
        log.touch()
        (Path(scratch) / "sitecustomize.py").write_text(
            SITECUSTOMIZE.format(log=str(log), watched=WATCHED)
        )
        path = os.pathsep.join(p for p in (scratch, os.environ.get("PYTHONPATH")) if p)
        hz = os.sysconf("SC_CLK_TCK")
        busy0, idle0 = _busy_idle_ticks()
        start = time.monotonic()
        done = subprocess.run(
            ["bash", str(REPO / "scripts" / "test.sh"), *args.pytest_args],
            env={**os.environ, "PYTHONPATH": path},
        )
        wall_s = time.monotonic() - start
        busy1, idle1 = _busy_idle_ticks()
        counts = collections.Counter(line.split()[1] for line in log.read_text().splitlines())
    torch_s = _import_cpu_s("import torch", python, args.repeats)
    both_s = _import_cpu_s("import torch, torch._dynamo", python, args.repeats)
    floor_s = counts["torch"] * torch_s + counts["torch._dynamo"] * (both_s - torch_s)
    busy_s, idle_s = (busy1 - busy0) / hz, (idle1 - idle0) / hz
    workers = os.environ.get("DDPKIT_TEST_WORKERS", "scripts/test.sh's default")
    print(
        f"scripts/test.sh exit status {done.returncode}, wall {wall_s:.0f} s, "
        f"{os.cpu_count()} CPUs, pytest workers: {workers}"
    )
    print(
        f"CPU: busy {busy_s:.0f} core-s, idle {idle_s:.0f} core-s "
        f"({busy_s / (busy_s + idle_s):.0%} busy)"
    )
    print(
        f"processes importing torch: {counts['torch']} ({torch_s:.2f} CPU-s each); "
        f"of them also torch._dynamo: {counts['torch._dynamo']} (+{both_s - torch_s:.2f} s)"
    )
    print(
        f"import floor: {floor_s:.0f} core-s ({floor_s / busy_s:.0%} of the busy time); "
        f"at {os.cpu_count()} cores that alone is {floor_s / os.cpu_count():.0f} s of wall"
    )
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
