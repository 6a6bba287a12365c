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

import time
from collections import Counter

import pytest

from tests.multinode.elastic_job import (
    NUM_SAMPLES,
    read_events,
    saved,
    start_ddpkit,
    start_torchrun,
    wait_for,
    worker_groups,
)
from tests.multinode.netns import (
    NamespacesUnavailable,
    Node,
    finish,
    kill_node,
    listeners,
    switched_nodes,
)

pytestmark = pytest.mark.slow
EPOCHS, STEP_S, SHRUNK_STEP_S = (
    2,
    0.1,
    0.5,
)  # the script: 20 steps of 6 x 3 ranks an epoch, 30 of 6 x 2


@pytest.fixture
def nodes():
    try:
        with switched_nodes(3) as created:
            yield created
    except NamespacesUnavailable as exc:
        pytest.skip(str(exc))


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
def test_lost_node_survivors_resume_on_two_then_the_node_rejoins(nodes, tmp_path, monkeypatch):
    monkeypatch.setenv("DDPKIT_JOB_TOKEN", "elastic-" + "0123456789abcdef")  # every group checks it
    # on 2 ranks, 0.5 s a step, 2 s while the test holds them: the 40 steps left give the node
    # started again (its launcher imports torch, seconds on a loaded machine) 80 s to reach the
    # rendezvous before the end
    job = [str(tmp_path), str(EPOCHS), str(STEP_S), str(SHRUNK_STEP_S)]
    first = [start_ddpkit(node, rank, nodes[0], job) for rank, node in enumerate(nodes)]
    wait_for(tmp_path, first, "a checkpoint on 3 ranks", saved(3, 8))
    _check_bound(nodes)
    kill_node(nodes[2])
    killed_s = time.time()
    survivors = first[:2]
    wait_for(tmp_path, survivors, "a checkpoint on 2 ranks after the resume", saved(2, 16))
    (tmp_path / "hold").touch()
    back = start_ddpkit(nodes[2], 2, nodes[0], job)
    wait_for(
        tmp_path,
        [*survivors, back],
        "the rejoined node training",
        lambda events: any(
            e["event"] == "step" and e["world_size"] == 3 and e["time_s"] > killed_s for e in events
        ),
    )
    _check_bound(nodes)  # while held: released, the 3 ranks end in seconds, their sockets too
    (tmp_path / "hold").unlink()
    results = finish([*survivors, back], 240)
    assert finish([first[2]], 10)[0][0] == -9  # the lost node's launcher: SIGKILLed
    for code, out in results:
        assert code == 0, out
    output = "".join(out for _, out in results)
    assert "node(s) waiting to join; restarting the workers to take them in" in output, output
    assert "rendezvous complete: 2 node(s), world size 2" in results[0][1], results[0][1]

    attempts = worker_groups(read_events(tmp_path))
    assert [(a["world_size"], sorted(a["ranks"])) for a in attempts] == [
        (3, [0, 1, 2]),
        (2, [0, 1]),
        (3, [0, 1, 2]),
    ], attempts
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
    job = [str(tmp_path), str(EPOCHS), str(STEP_S)]
    procs = [start_torchrun(node, nodes[0], job) for node in nodes]
    wait_for(tmp_path, procs, "a checkpoint on 3 ranks", saved(3, 8))
    kill_node(nodes[2])
    killed_s = time.time()
    results = finish(procs[:2], 240)
    for code, out in results:
        assert code == 0, out
    attempts = worker_groups(read_events(tmp_path))
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
    job = [str(tmp_path), str(EPOCHS), str(STEP_S)]
    procs = [start_ddpkit(node, rank, nodes[0], job) for rank, node in enumerate(nodes)]
    wait_for(tmp_path, procs, "a checkpoint on 3 ranks", saved(3, 8))
    kill_node(nodes[0])
    killed_s = time.monotonic()
    results = finish(procs[1:], 60)
    elapsed_s = time.monotonic() - killed_s
    print(f"\nnode 0 lost -> nodes 1 and 2 ended in {elapsed_s:.1f} s")
    for code, out in results:
        assert code == 1, out
        assert "no longer answers: node 0, which hosts it, is gone or unreachable" in out, out
    assert elapsed_s < 30, elapsed_s  # the workers fail at once; the store refuses at once


def test_fewer_than_min_nodes_end_after_the_join_timeout_saying_so(tmp_path):
    try:
        with switched_nodes(1) as [node]:
            job = [str(tmp_path), str(EPOCHS), str(STEP_S)]
            start = time.monotonic()
            [(code, out)] = finish([start_ddpkit(node, 0, node, job, "join_timeout=5")], 90)
    except NamespacesUnavailable as exc:
        pytest.skip(str(exc))
    assert code == 1, out
    assert "timed out: fewer than 2 node(s) joined within its join_timeout" in out, out
    assert time.monotonic() - start < 60
    assert not list(tmp_path.glob("log-*.jsonl"))  # no worker started
