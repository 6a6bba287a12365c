"""A finished job exits cleanly: no gloo thread survives the runtime's close.

Root cause of the exit-time abort (see ddpkit.distributed.process_group): torch's
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
