"""Elastic membership for real: 3 nodes (network namespaces on one private switch), one lost.

``ddpkit run --nnodes 2:3`` on each node, 1 process each, the README's own loop with
checkpoints every 4 steps (``scripts/elastic_train.py``, which logs the indices of the samples
every rank trains on). Every process of a node is SIGKILLed once a checkpoint is reported
(never after a sleep); the agents on the other two nodes restart their workers, which resume
from that checkpoint on 2 ranks; then the node comes back and is taken in at the next
rendezvous. Counting the logged samples shows every sample of every epoch trained exactly once
in the history that the checkpoints kept. Losing node 0, which hosts the rendezvous store, ends
the job on the others at once with a line saying so. The same loss under plain torchrun, for
comparison. Needs root and ``ip``; skipped with the reason otherwise.

The rendezvous timings are shortened (``RDZV_CONF``) to keep the tests short; torch's defaults
(30 s last call, 15 s to declare a node dead) are measured in ``bench/elastic_restart.py``.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.multinode.netns import (
    NamespacesUnavailable,
    Node,
    finish,
    kill_node,
    listeners,
    start_in,
    switched_nodes,
)

pytestmark = pytest.mark.slow
SCRIPT = str(Path(__file__).parent / "scripts" / "elastic_train.py")
NUM_SAMPLES, EPOCHS, STEP_S = 360, 2, 0.1  # the script: 20 steps of 6 x 3 ranks, 30 of 6 x 2
RDZV_CONF = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"
PORT = 29400  # inside namespaces this test created: no other process can hold it


@pytest.fixture
def nodes():
    try:
        with switched_nodes(3) as created:
            yield created
    except NamespacesUnavailable as exc:
        pytest.skip(str(exc))


def _ddpkit(node: Node, rank: int, endpoint: Node, out: Path):
    return start_in(
        node,
        ["-m", "ddpkit", "run", "-n", "1", "--nnodes", "2:3", "--node-rank", str(rank),
         "--rdzv-endpoint", f"{endpoint.address}:{PORT}", "--rdzv-conf", RDZV_CONF,
         SCRIPT, str(out), str(EPOCHS), str(STEP_S)],
    )  # fmt: skip


def _torchrun(node: Node, endpoint: Node, out: Path):
    """Plain torchrun, told what ddpkit works out itself: the address to advertise, gloo's
    interface, and (node 0) that it hosts the store (its own check compares hostnames)."""
    host = ",is_host=1" if node == endpoint else ""
    return start_in(
        node,
        ["-m", "torch.distributed.run", "--nnodes", "2:3", "--nproc-per-node", "1",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{endpoint.address}:{PORT}",
         "--rdzv-conf", RDZV_CONF + host, "--max-restarts", "3", "--local-addr", node.address,
         SCRIPT, str(out), str(EPOCHS), str(STEP_S)],
        env={"GLOO_SOCKET_IFNAME": node.ifname},
    )  # fmt: skip


def _events(out: Path) -> list[dict]:
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


def _wait_for(out: Path, procs: list, what: str, predicate, timeout_s: float = 150) -> list[dict]:
    """Poll the logs until ``predicate(events)`` holds; fail at once if a launcher has exited."""
    deadline = time.monotonic() + timeout_s
    while not predicate(events := _events(out)):
        ended = [p.returncode for p in procs if p.poll() is not None]
        assert not ended, (what, ended, finish(procs, 10))
        assert time.monotonic() < deadline, (f"timed out waiting for {what}", finish(procs, 10))
        time.sleep(0.05)
    return events


def _saved(world_size: int, at_least: int):
    return lambda events: any(
        e["event"] == "saved" and e["world_size"] == world_size and e["step"] >= at_least
        for e in events
    )


def _attempts(events: list[dict]) -> list[dict]:
    """The worker groups in start order: world size, resumed step, ranks, steps, saves."""
    groups: dict[tuple[int, int], dict] = {}
    for e in events:
        size, resumed = e["attempt"]
        group = groups.setdefault(
            e["attempt"],
            {"world_size": size, "resumed": resumed, "start_s": e["time_s"], "ranks": [],
             "steps": [], "saved": []},
        )  # fmt: skip
        if e["event"] == "start":
            group["ranks"].append(e["rank"])
        elif e["event"] == "step":
            group["steps"].append(e)
        elif e["event"] == "saved":
            group["saved"].append(e["step"])
    return sorted(groups.values(), key=lambda g: g["start_s"])


def _check_every_sample_once(attempts: list[dict]) -> None:
    """In the kept history (each attempt up to the step the next one resumed from), every
    epoch trained each of the samples exactly once."""
    per_epoch: dict[int, Counter] = {}
    for i, attempt in enumerate(attempts):
        until = attempts[i + 1]["resumed"] if i + 1 < len(attempts) else float("inf")
        for e in attempt["steps"]:
            if e["step"] <= until:
                per_epoch.setdefault(e["epoch"], Counter()).update(e["samples"])
    assert sorted(per_epoch) == list(range(EPOCHS))
    for epoch, seen in per_epoch.items():
        assert set(seen) == set(range(NUM_SAMPLES)), (epoch, set(range(NUM_SAMPLES)) - set(seen))
        assert set(seen.values()) == {1}, (epoch, {i: n for i, n in seen.items() if n != 1})


def _check_bound(nodes: list[Node]) -> None:
    """Every listener of every node on that node's own address (as on two fixed nodes)."""
    for node in nodes:
        found = listeners(node)
        assert found and {a.rpartition(":")[0] for a in found} == {node.address}, (node, found)
    assert len(listeners(nodes[0])) >= 3  # the rendezvous store, the job store, gloo


@pytest.mark.timeout(420)
def test_lost_node_survivors_resume_on_two_then_the_node_rejoins(nodes, tmp_path):
    first = [_ddpkit(node, rank, nodes[0], tmp_path) for rank, node in enumerate(nodes)]
    _wait_for(tmp_path, first, "a checkpoint on 3 ranks", _saved(3, 8))
    _check_bound(nodes)
    kill_node(nodes[2])
    killed_s = time.time()
    survivors = first[:2]
    _wait_for(tmp_path, survivors, "a checkpoint on 2 ranks after the resume", _saved(2, 16))
    back = _ddpkit(nodes[2], 2, nodes[0], tmp_path)
    _wait_for(tmp_path, [*survivors, back], "the rejoined node training",
              lambda events: any(e["event"] == "step" and e["world_size"] == 3 and
                                 e["time_s"] > killed_s for e in events))  # fmt: skip
    _check_bound(nodes)
    results = finish([*survivors, back], 240)
    assert finish([first[2]], 10)[0][0] == -9  # the lost node's launcher: SIGKILLed
    for code, out in results:
        assert code == 0, out
    output = "".join(out for _, out in results)
    assert "node(s) waiting to join; restarting the workers to take them in" in output, output
    assert "rendezvous complete: 2 node(s), world size 2" in results[0][1], results[0][1]

    attempts = _attempts(_events(tmp_path))
    assert [(a["world_size"], sorted(a["ranks"])) for a in attempts] == [
        (3, [0, 1, 2]), (2, [0, 1]), (3, [0, 1, 2])
    ], attempts  # fmt: skip
    lost, resized, rejoined = attempts
    # each resumed from the newest checkpoint its predecessor reported complete
    assert lost["resumed"] == 0 and resized["resumed"] == max(lost["saved"]) >= 8
    assert rejoined["resumed"] >= max(resized["saved"]) >= 16
    assert rejoined["resumed"] <= max(e["step"] for e in resized["steps"])
    _check_every_sample_once(attempts)
    resumed_s = min(e["time_s"] for e in resized["steps"])
    print(f"\nddpkit run: node lost -> training resumed on 2 nodes in {resumed_s - killed_s:.1f} s")


@pytest.mark.timeout(300)
def test_plain_torchrun_survives_the_same_loss(nodes, tmp_path):
    procs = [_torchrun(node, nodes[0], tmp_path) for node in nodes]
    _wait_for(tmp_path, procs, "a checkpoint on 3 ranks", _saved(3, 8))
    kill_node(nodes[2])
    killed_s = time.time()
    results = finish(procs[:2], 240)
    for code, out in results:
        assert code == 0, out
    attempts = _attempts(_events(tmp_path))
    assert [(a["world_size"], sorted(a["ranks"])) for a in attempts] == [
        (3, [0, 1, 2]),
        (2, [0, 1]),
    ]
    assert attempts[1]["resumed"] == max(attempts[0]["saved"]) >= 8
    _check_every_sample_once(attempts)
    resumed_s = min(e["time_s"] for e in attempts[1]["steps"])
    print(f"\ntorchrun: node lost -> training resumed on 2 nodes in {resumed_s - killed_s:.1f} s")


@pytest.mark.timeout(240)
def test_losing_node_zero_ends_the_others_at_once_saying_why(nodes, tmp_path):
    procs = [_ddpkit(node, rank, nodes[0], tmp_path) for rank, node in enumerate(nodes)]
    _wait_for(tmp_path, procs, "a checkpoint on 3 ranks", _saved(3, 8))
    kill_node(nodes[0])
    killed_s = time.monotonic()
    results = finish(procs[1:], 60)
    elapsed_s = time.monotonic() - killed_s
    for code, out in results:
        assert code == 1, out
        assert "cannot reach the rendezvous store at" in out, out
        assert "node 0, which hosts it, is gone or unreachable" in out, out
    assert elapsed_s < 30, elapsed_s  # the workers fail at once; the store refuses at once
