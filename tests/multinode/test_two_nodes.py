"""Two nodes for real: two network namespaces joined by a veth pair, created and removed here.

Every process of these tests runs inside one of the namespaces (``ip netns exec``), and the
private addresses exist only between them, so nothing leaves the machine. Needs root and
``ip``; skipped with the reason otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
import torch

from tests.multinode.netns import finish as _finish
from tests.multinode.netns import ip as _ip

SCRIPT = """
import sys, torch
from torch.nn import functional as F
import ddpkit
from ddpkit.app.mnist.model import MnistCNN

with ddpkit.init_runtime("gloo", init_timeout_s=60, train_timeout_s=60) as rt:
    g = torch.Generator().manual_seed(0)
    images = torch.randn(64, 1, 28, 28, generator=g)  # MNIST-shaped
    labels = torch.randint(0, 10, (64,), generator=g)
    dataset = torch.utils.data.TensorDataset(images, labels)
    torch.manual_seed(0)
    model = ddpkit.wrap_model(MnistCNN(), rt)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in ddpkit.build_train_loader(dataset, rt, batch_size=8, seed=0):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    if rt.rank == 0:
        torch.save(ddpkit.model_state_dict(model), sys.argv[1])
    print(f"rank {rt.rank} of {rt.world_size} done")
"""


@pytest.fixture
def namespaces():
    """``(ns_a, ns_b, addr_a, addr_b, veth_a)``: two namespaces linked by a veth pair."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and the ip command")
    tag = uuid.uuid4().hex[:6]
    ns_a, ns_b, veth_a, veth_b = f"ddpk-{tag}-a", f"ddpk-{tag}-b", f"dk{tag}a", f"dk{tag}b"
    subnet = f"10.231.{int(tag[:2], 16)}"
    created = []
    try:
        for ns in (ns_a, ns_b):
            _ip("netns", "add", ns)
            created.append(ns)
    except subprocess.CalledProcessError as exc:
        for ns in created:
            _ip("netns", "del", ns)
        pytest.skip(f"network namespaces not permitted here: {exc.stderr.strip()}")
    try:
        try:
            _ip("link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
            for ns, veth, host in ((ns_a, veth_a, 1), (ns_b, veth_b, 2)):
                _ip("link", "set", veth, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{subnet}.{host}/24", "dev", veth)
                _ip("-n", ns, "link", "set", veth, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot link the namespaces with a veth pair: {exc.stderr.strip()}")
        yield ns_a, ns_b, f"{subnet}.1", f"{subnet}.2", veth_a
    finally:
        for ns in (ns_a, ns_b):  # deleting a namespace deletes its end of the veth pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        # a pair that never left the host namespace (a failed set-up) is removed here
        subprocess.run(["ip", "link", "del", veth_a], capture_output=True, timeout=30)


def _start(ns: str, args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-m", "ddpkit", "run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def test_two_nodes_match_one_node_with_two_processes(namespaces, tmp_path):
    ns_a, ns_b, addr_a, _, _ = namespaces
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    [(code, out)] = _finish([_start(ns_a, ["-n", "2", str(script), str(tmp_path / "one.pt")])], 120)
    assert code == 0, out
    endpoint = ["--nnodes", "2", "--rdzv-endpoint", f"{addr_a}:29400", "-n", "1"]
    nodes = [
        _start(ns, [*endpoint, "--node-rank", str(rank), str(script), str(tmp_path / "two.pt")])
        for rank, ns in enumerate((ns_a, ns_b))
    ]
    results = _finish(nodes, 180)
    for code, out in results:
        assert code == 0, out
    assert "rank 0 of 2 done" in "".join(out for _, out in results)
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert one.keys() == two.keys()
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=0, atol=1e-6)


LOOP = """
import pathlib, sys, time
import ddpkit

with ddpkit.init_runtime("gloo", init_timeout_s=60, train_timeout_s=15, stall_timeout_s=5) as rt:
    start = time.monotonic()
    while True:
        ddpkit.all_reduce_sum([1.0], rt)
        if time.monotonic() - start > 3:  # heartbeats have been exchanged by now
            pathlib.Path(sys.argv[1] + f".{rt.rank}").touch()
        time.sleep(0.01)
"""


def test_link_down_fails_both_nodes_naming_the_lost_peer(namespaces, tmp_path):
    ns_a, ns_b, addr_a, addr_b, veth_a = namespaces
    script = tmp_path / "loop.py"
    script.write_text(textwrap.dedent(LOOP))
    endpoint = ["--nnodes", "2", "--rdzv-endpoint", f"{addr_a}:29400", "-n", "1"]
    marker = str(tmp_path / "running")
    nodes = [
        _start(ns, [*endpoint, "--node-rank", str(rank), str(script), marker])
        for rank, ns in enumerate((ns_a, ns_b))
    ]
    deadline = time.monotonic() + 120
    while not all(os.path.exists(f"{marker}.{rank}") for rank in (0, 1)):
        assert all(n.poll() is None for n in nodes), _finish(nodes, 10)
        assert time.monotonic() < deadline, "the job did not start"
        time.sleep(0.05)
    _ip("-n", ns_a, "link", "set", veth_a, "down")
    start = time.monotonic()
    results = _finish(nodes, 90)
    elapsed_s = time.monotonic() - start
    (code_a, out_a), (code_b, out_b) = results
    assert code_a == 1 and code_b == 1, (out_a, out_b)
    # node A (the store's node) sees rank 1 go silent; node B loses rank 0 and the store
    assert "late rank(s): 1" in out_a and "rank 1: silent for" in out_a, out_a
    assert "all_reduce failed on rank 1/2: a peer stopped answering" in out_b, out_b
    assert "No heartbeat from rank 0 for" in out_b, out_b
    # the workers fail within the 15 s training timeout; node B's launcher within its guard
    assert elapsed_s < 15 + 2 * 10 + 10, elapsed_s
