"""A finished job exits cleanly: no gloo thread survives the runtime's close.

Root cause of the exit-time abort (see ddpkit.runtime.process_group): torch's
``torch.distributed.nn.functional`` captures the live default group in its functions' default
arguments when DDP imports it after ``init_process_group``; the group can then never be freed and
its threads are torn down during interpreter finalization.
"""

from __future__ import annotations

import gc
import glob

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.testing import run_distributed

GLOO_THREADS = {"pt_gloo_runloop", "gloo_tcp_loop"}


def _thread_names() -> list[str]:
    names = []
    for path in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(path) as handle:
                names.append(handle.read().strip())
        except FileNotFoundError:  # a thread that just ended
            pass
    return names


def _train_then_close(store) -> tuple[int, int, list]:
    with ddpkit.init_runtime("gloo", init_timeout_s=30, train_timeout_s=30, store=store) as rt:
        model = ddpkit.wrap_model(nn.Linear(8, 2), rt)  # DDP imports the module below, late
        import torch.distributed.nn.functional as dist_nn_functional

        model(torch.randn(4, 8)).sum().backward()
        during = sum(name in GLOO_THREADS for name in _thread_names())
        captured = [
            d
            for d in dist_nn_functional.all_reduce.__defaults__
            if d is not None and not isinstance(d, type(torch.distributed.ReduceOp.SUM))
        ]
    del model
    gc.collect()
    after = sum(name in GLOO_THREADS for name in _thread_names())
    return during, after, [repr(c) for c in captured]


@pytest.mark.slow
def test_gloo_threads_end_with_the_runtime():
    # spawn, not the forkserver: the import order under test is a virgin interpreter's (the
    # forkserver has already imported torch.distributed.nn.functional through ddpkit).
    for during, after, captured in run_distributed(
        _train_then_close, 2, init=False, start_method="spawn"
    ):
        assert during >= 2  # the groups really ran gloo threads
        assert captured == []  # torch's module kept no reference to the default group
        assert after == 0


def _collectives_after_close(rt) -> dict[str, str]:
    """Each ddpkit collective called after the runtime closed: the first line of what it
    raised, or what it returned (before: the local value, silently)."""
    total = ddpkit.all_reduce_sum([rt.rank + 1.0], rt).tolist()  # inside: the job's sum
    rt.close()
    calls = {
        "all_reduce_sum": lambda: ddpkit.all_reduce_sum([rt.rank + 1.0], rt).tolist(),
        "all_reduce": lambda: ddpkit.all_reduce(torch.ones(2), rt).tolist(),
        "barrier": lambda: ddpkit.barrier(rt),
        "all_gather": lambda: ddpkit.all_gather(torch.ones(2), rt),
        "all_gather_object": lambda: ddpkit.all_gather_object(rt.rank, rt),
    }
    out = {"inside": repr(total)}
    for name, call in calls.items():
        try:
            out[name] = f"returned {call()!r}"
        except ddpkit.DistributedError as exc:
            out[name] = str(exc)
    return out


def test_collectives_after_the_runtime_closed_raise_instead_of_answering_alone():
    for rank, out in enumerate(run_distributed(_collectives_after_close, 2)):
        assert out.pop("inside") == "[3.0]"
        for name, said in out.items():
            op = "all_reduce" if name == "all_reduce_sum" else name
            assert said.startswith(
                f"{op} after the runtime closed: rank={rank}, world_size=2. The process group is "
                "gone"
            ), (name, said)
            assert "before rt.close()" in said


def _close_at_once_while_a_peer_connects_late(store) -> bool:
    """Rank 1 leaves ``new_group`` 0.5 s late (a slow tail of gloo's connectFullMesh, as a
    loaded machine gives it); rank 0 reports whether rank 1 had left by the time init returned."""
    import os
    import time

    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    real_new_group = dist.new_group

    def slow_tail(*args, **kwargs):
        group = real_new_group(*args, **kwargs)
        if rank == 1:
            time.sleep(0.5)
            store.set("rank1_connected", "1")
        return group

    dist.new_group = slow_tail
    try:
        with ddpkit.init_runtime("gloo", init_timeout_s=30, train_timeout_s=30, store=store):
            return store.check(["rank1_connected"])
    finally:
        dist.new_group = real_new_group


def test_init_returns_on_no_rank_while_a_peer_still_connects_the_training_group():
    # Without the barrier in init_runtime, a rank whose script ended at once closed its
    # sockets while a peer was still in connectFullMesh: "Connection closed by peer" on the
    # peer (3% of 2-rank runs with two jobs side by side; a CI failure of
    # test_dp_is_refused_in_a_multi_process_job).
    connected_at_return = run_distributed(_close_at_once_while_a_peer_connects_late, 2, init=False)
    assert connected_at_return == [True, True]
