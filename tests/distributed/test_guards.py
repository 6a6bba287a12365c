"""Cross-rank guards: NaN on one rank decided by all, divergence named, step skew caught."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ddpkit
from ddpkit.diagnostics.failures import read_records
from ddpkit.guards.nonfinite import NonFiniteGuard, check_replicas
from ddpkit.testing import DistributedTestError, run_distributed


def _train_with_nan(runtime, mode: str):
    torch.manual_seed(0)
    model = ddpkit.wrap_model(nn.Linear(4, 2), runtime)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = NonFiniteGuard(runtime, mode)
    stepped = []
    for step in range(1, 6):
        optimizer.zero_grad()
        loss = F.mse_loss(model(torch.ones(3, 4) * step), torch.zeros(3, 2))
        if runtime.rank == 1 and step == 3:
            loss = loss * float("nan")  # NaN only in rank 1's loss
        loss.backward()
        try:
            if guard.check(step, loss, model=model):
                optimizer.step()
                stepped.append(step)
        except ddpkit.DistributedError as exc:
            return {"error": str(exc)}
    check_replicas(model, runtime, step=5)  # raises if the replicas differ
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {
        "stepped": stepped,
        "skipped": guard.num_skipped,
        "finite": bool(params.isfinite().all()),
    }


def test_nan_on_one_rank_is_skipped_by_all():
    results = run_distributed(_train_with_nan, 2, args=("skip",))
    assert results[0] == results[1] == {"stepped": [1, 2, 4, 5], "skipped": 1, "finite": True}


def test_nan_on_one_rank_raises_on_all_naming_rank_and_step():
    results = run_distributed(_train_with_nan, 2, args=("raise",))
    for result in results:
        assert "non-finite loss at step 3 on rank(s) 1." in result["error"]


def _perturb_one_rank(runtime):
    model = ddpkit.wrap_model(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)), runtime)
    if runtime.rank == 2:
        with torch.no_grad():
            ddpkit.unwrap_model(model)[1].weight[0, 0] += 1e-6
    check_replicas(model, runtime, step=7)


def test_divergence_names_rank_and_parameter():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_perturb_one_rank, 3)
    assert "replicas diverged at step 7: rank 2 differs in module.1.weight" in str(info.value)


def _skewed_steps(runtime):
    model = nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    NonFiniteGuard(runtime).check(4 if runtime.rank == 0 else 5, torch.tensor(1.0), model=model)


def test_step_counter_skew_is_reported():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_skewed_steps, 2)
    assert "step counters differ across ranks: rank 0 at step 4, rank 1 at step 5" in str(
        info.value
    )


def _mismatched_all_reduce(runtime, shapes):
    runtime.debug_collectives = True
    ddpkit.all_reduce(torch.ones(shapes[runtime.rank]), runtime)


@pytest.mark.parametrize(
    "shapes,expected",
    [
        ([(4,), (8,)], "rank 0 float32 (4,), rank 1 float32 (8,)"),
        ([(2, 4), (4, 2)], "rank 0 float32 (2, 4), rank 1 float32 (4, 2)"),  # same numel
    ],
)
def test_collective_shape_check_names_each_ranks_shape(shapes, expected):
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_mismatched_all_reduce, 2, args=(shapes,))
    message = str(info.value)
    assert "all_reduce: tensors differ across ranks: " + expected in message


def _matched_all_reduce(runtime):
    runtime.debug_collectives = True
    return ddpkit.all_reduce(torch.full((2, 3), float(runtime.rank + 1)), runtime).tolist()


def test_collective_shape_check_passes_matching_tensors():
    assert run_distributed(_matched_all_reduce, 3) == [[[6.0] * 3] * 2] * 3


def _checked_against_a_raw_all_reduce(runtime):
    if runtime.rank == 0:
        ddpkit.all_reduce(torch.ones(4), runtime)  # shape-checked first (debug switch)
    else:  # a raw torch call, or DDP's bucket all-reduce: nothing to compare shapes with
        torch.distributed.all_reduce(torch.ones(8), group=runtime.process_group)


def test_debug_switch_never_turns_a_fast_failure_into_a_hang(tmp_path):
    # without the switch gloo aborts this at once ("collective mismatch"); with it, the shape
    # check's own collective must fail as fast, not wait for a partner that never comes
    env = {"DDPKIT_DEBUG_COLLECTIVES": "1", "DDPKIT_RUN_DIR": str(tmp_path)}
    start = time.monotonic()
    with pytest.raises(DistributedTestError):
        run_distributed(_checked_against_a_raw_all_reduce, 2, env=env, timeout_s=60)
    assert time.monotonic() - start < 5.0  # below the watchdog's deadlock timeout
    assert "DeadlockError" not in {record.type for record in read_records(tmp_path)}
