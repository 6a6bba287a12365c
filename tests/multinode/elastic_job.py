"""The elastic job of the multi-node tests and ``bench/elastic_restart.py``: the commands on
each node (``ddpkit run``, plain torchrun), and the events ``scripts/elastic_train.py`` logs.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from tests.multinode.netns import Node, finish, start_in

SCRIPT = str(Path(__file__).parent / "scripts" / "elastic_train.py")
NUM_SAMPLES = 360  # the script's data set
# rendezvous timings short enough for a test (torch: 30 s last call, 5 s x 3 to declare death)
RDZV_CONF = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"
PORT = 29400  # inside namespaces a test created: no other process can hold it


def start_ddpkit(
    node: Node, rank: int, endpoint: Node, job: list[str], rdzv_conf: str = RDZV_CONF
) -> subprocess.Popen:
    """``ddpkit run -n 1 --nnodes 2:3`` of the script on ``node`` (``job``: OUT EPOCHS STEP_S)."""
    conf = ["--rdzv-conf", rdzv_conf] if rdzv_conf else []
    return start_in(
        node,
        [
            "-m",
            "ddpkit",
            "run",
            "-n",
            "1",
            "--nnodes",
            "2:3",
            "--node-rank",
            str(rank),
            "--rdzv-endpoint",
            f"{endpoint.address}:{PORT}",
            *conf,
            SCRIPT,
            *job,
        ],
    )


def start_torchrun(
    node: Node, endpoint: Node, job: list[str], rdzv_conf: str = RDZV_CONF
) -> subprocess.Popen:
    """Plain torchrun, told what ddpkit works out itself: the address to advertise, gloo's
    interface, and (node 0) that it hosts the store (its own check compares hostnames)."""
    conf = ",".join(filter(None, [rdzv_conf, "is_host=1" if node == endpoint else ""]))
    return start_in(
        node,
        [
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2:3",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{endpoint.address}:{PORT}",
            *(["--rdzv-conf", conf] if conf else []),
            "--max-restarts",
            "3",
            "--local-addr",
            node.address,
            SCRIPT,
            *job,
        ],
        env={"GLOO_SOCKET_IFNAME": node.ifname},
    )


def read_events(out: Path) -> list[dict]:
    """Every complete line the processes logged, oldest first, each tagged with its process's
    ``attempt``: (world size, the step it resumed from), from the process's first line."""
    found = []
    for path in out.glob("log-*.jsonl"):
        lines = []
        for line in path.read_text().splitlines():
            try:
                lines.append(json.loads(line))
            except ValueError:  # a line being written
                continue
        if lines and lines[0]["event"] == "start":
            attempt = (lines[0]["world_size"], lines[0]["step"])
            found += [{**e, "attempt": attempt} for e in lines]
    return sorted(found, key=lambda e: e["time_s"])


def wait_for(
    out: Path,
    procs: list[subprocess.Popen],
    what: str,
    predicate: Callable[[list[dict]], bool],
    timeout_s: float = 150,
) -> list[dict]:
    """Poll the logs until ``predicate(events)`` holds; fail at once if a launcher has exited."""
    deadline = time.monotonic() + timeout_s
    while not predicate(events := read_events(out)):
        ended = [p.returncode for p in procs if p.poll() is not None]
        assert not ended, (what, ended, finish(procs, 10))
        assert time.monotonic() < deadline, (f"timed out waiting for {what}", finish(procs, 10))
        time.sleep(0.05)
    return events


def saved(world_size: int, at_least: int) -> Callable[[list[dict]], bool]:
    """A checkpoint of step ``at_least`` or later reported complete on ``world_size`` ranks."""
    return lambda events: any(
        e["event"] == "saved" and e["world_size"] == world_size and e["step"] >= at_least
        for e in events
    )


def worker_groups(events: list[dict]) -> list[dict]:
    """The worker groups in start order: world size, resumed step, ranks, steps, saves."""
    groups: dict[tuple[int, int], dict] = {}
    for e in events:
        size, resumed = e["attempt"]
        group = groups.setdefault(
            e["attempt"],
            {
                "world_size": size,
                "resumed": resumed,
                "start_s": e["time_s"],
                "ranks": [],
                "steps": [],
                "saved": [],
            },
        )
        if e["event"] == "start":
            group["ranks"].append(e["rank"])
        elif e["event"] == "step":
            group["steps"].append(e)
        elif e["event"] == "saved":
            group["saved"].append(e["step"])
    return sorted(groups.values(), key=lambda g: g["start_s"])
