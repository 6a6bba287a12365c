"""TrainStep and train_epoch on real gloo ranks: values, not "it runs".

- K micro-steps on 2 and 3 ranks take the same optimizer step as one process on the global
  batch, and the step's loss sums to that batch's mean loss;
- a non-finite step is skipped on every rank and leaves every rank's parameters unchanged;
- 16-mixed: one rank's overflow makes every rank skip and halve its loss scale;
- the generator yields exactly one result per optimizer step, numbered, and stops at max_steps.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit import StepResult, TrainStep, train_epoch
from ddpkit.env import ProcessInfo
from ddpkit.guards.nonfinite import NonFiniteGuard
from ddpkit.runtime.process_group import Runtime
from ddpkit.testing import run_distributed
from ddpkit.training.precision import MixedPrecision

PER_RANK_BATCH = 4
K = 2
LR = 0.5


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _dataset(num_samples: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(5)
    return TensorDataset(
        torch.randn(num_samples, 6, generator=gen),
        torch.randint(0, 3, (num_samples,), generator=gen),
    )


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in ddpkit.unwrap_model(model).parameters()])


def _num_samples(world_size: int) -> int:
    # per rank: batches of 4, 4, 4, 4, 2 -> windows (4, 4), (4, 4), (2): a short last window
    return 18 * world_size


def _equivalence_rank(runtime: Runtime) -> dict:
    model = ddpkit.wrap_model(_net(), runtime)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data = _dataset(_num_samples(runtime.world_size))
    loader = ddpkit.build_train_loader(data, runtime, batch_size=PER_RANK_BATCH, seed=3)
    step = TrainStep(model, optimizer, runtime=runtime, num_micro_steps=K, clip_grad_norm=100.0)
    params, results = [], []
    for result in train_epoch(step, loader):
        params.append(_flat(model))
        results.append(result)
    return {"params": params, "results": results}


def _reference(world_size: int) -> tuple[list[torch.Tensor], list[float], list[float]]:
    """One process, no accumulation: each optimizer step takes the whole global batch."""
    single = Runtime(ProcessInfo())
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data = _dataset(_num_samples(world_size))
    global_batch = PER_RANK_BATCH * world_size * K
    loader = ddpkit.build_train_loader(data, single, batch_size=global_batch, seed=3)
    params, losses, norms = [], [], []
    for x, y in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 100.0)))
        optimizer.step()
        params.append(_flat(model))
        losses.append(float(loss.detach()))
    return params, losses, norms


@pytest.mark.parametrize("world_size", [2, 3])
def test_k_micro_steps_on_n_ranks_equal_one_big_batch(world_size):
    per_rank = run_distributed(_equivalence_rank, world_size)
    ref_params, ref_losses, ref_norms = _reference(world_size)
    assert len(ref_params) == 3  # two full global batches and a short one
    for rank, got in enumerate(per_rank):
        results = got["results"]
        assert [r.step for r in results] == [1, 2, 3]
        assert [len(r.loss_sums) for r in results] == [2, 2, 1]  # K, K, then the rest
        assert [r.num_samples for r in results] == [8, 8, 2]
        assert [r.num_samples_global for r in results] == [8 * world_size] * 2 + [2 * world_size]
        assert not any(r.skipped for r in results)
        for index, (params, ref) in enumerate(zip(got["params"], ref_params, strict=True)):
            assert torch.equal(params, per_rank[0]["params"][index]), (rank, index)
            torch.testing.assert_close(params, ref, rtol=0, atol=1e-5)
        for result, ref_norm in zip(results, ref_norms, strict=True):
            assert result.grad_norm == pytest.approx(ref_norm, rel=1e-5)  # unclipped: 100
    # the ranks' loss sums over their samples give the global batch's mean loss
    for index, ref_loss in enumerate(ref_losses):
        step_results = [got["results"][index] for got in per_rank]
        loss_sum = sum(r.loss_sum for r in step_results)
        num_samples = sum(r.num_samples for r in step_results)
        assert num_samples == step_results[0].num_samples_global
        assert loss_sum / num_samples == pytest.approx(ref_loss, rel=1e-6)
        for r in step_results:
            assert r.loss == pytest.approx(r.loss_sum / r.num_samples, rel=1e-12)
    assert (ref_params[-1] - _flat(_net())).abs().max() > 1e-2  # the parameters really moved


def _skip_rank(runtime: Runtime) -> dict:
    """Rank 1's second batch holds a NaN: step 2 must be skipped on both ranks."""
    model = ddpkit.wrap_model(_net(), runtime)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    guard = NonFiniteGuard(runtime, "skip")
    step = TrainStep(model, optimizer, runtime=runtime, guard=guard)
    batches = [_dataset(4)[:] for _ in range(3)]
    if runtime.rank == 1:
        x, y = batches[1]
        batches[1] = (torch.where(torch.arange(6) == 2, math.nan, x), y)
    before, results = [], []
    for result in train_epoch(step, batches):
        results.append(result)
        before.append(_flat(model))
    return {"params": before, "results": results, "num_skipped": guard.num_skipped}


def _overflow_rank(runtime: Runtime) -> dict:
    """A plain module (no DDP) in 16-mixed: only rank 1's gradients overflow; all must skip."""
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    precision = MixedPrecision("16-mixed", runtime, init_scale=1024.0)
    step = TrainStep(model, optimizer, runtime=runtime, precision=precision, start_step=7)
    scale = 1e30 if runtime.rank == 1 else 1.0
    batches = [(x * s, y) for (x, y), s in ((_dataset(4)[:], 1.0), (_dataset(4)[:], scale))]
    params, results, scales = [], [], []
    for result in train_epoch(step, batches):
        results.append(result)
        params.append(_flat(model))
        scales.append(precision.scaler.get_scale())
    return {"params": params, "results": results, "scales": scales}


def _skip_cases(runtime: Runtime) -> dict:
    return {"nonfinite": _skip_rank(runtime), "overflow": _overflow_rank(runtime)}


@pytest.fixture(scope="module")
def skip_results() -> list[dict]:
    return run_distributed(_skip_cases, 2)


def test_a_skipped_nonfinite_step_leaves_parameters_unchanged_on_every_rank(skip_results):
    for got in (r["nonfinite"] for r in skip_results):
        assert [r.skipped for r in got["results"]] == [False, True, False]
        assert [r.step for r in got["results"]] == [1, 2, 3]
        assert got["num_skipped"] == 1
        after_1, after_2, after_3 = got["params"]
        assert torch.equal(after_2, after_1)  # the skipped step changed nothing
        assert not torch.equal(after_3, after_2)  # the next one trains again
        assert bool(after_3.isfinite().all())
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            skip_results[0]["nonfinite"]["params"],
            skip_results[1]["nonfinite"]["params"],
            strict=True,
        )
    )
    # rank 1's loss is NaN at step 2; rank 0's is finite: each result reports its own rank
    rank0, rank1 = (r["nonfinite"]["results"][1] for r in skip_results)
    assert math.isfinite(rank0.loss) and math.isnan(rank1.loss)


def test_16_mixed_skip_decisions_are_shared_by_every_rank(skip_results):
    for got in (r["overflow"] for r in skip_results):
        assert [r.step for r in got["results"]] == [8, 9]  # counted on from start_step=7
        assert [r.skipped for r in got["results"]] == [False, True]  # rank 0 skips too
        assert torch.equal(got["params"][1], got["params"][0])
        # growth_interval 2000: no growth after step 1; the overflow halved the scale
        assert got["scales"] == [1024.0, 512.0]


def test_the_generator_yields_one_result_per_optimizer_step_and_stops_at_max_steps():
    single = Runtime(ProcessInfo())
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = ddpkit.build_train_loader(
        _dataset(20), single, batch_size=PER_RANK_BATCH, seed=3
    )  # 5 batches
    step = TrainStep(model, optimizer, runtime=single, num_micro_steps=K)
    assert step.num_optimizer_steps(len(loader)) == 3
    results = list(train_epoch(step, loader))
    assert all(isinstance(r, StepResult) for r in results)
    assert [r.step for r in results] == [1, 2, 3]  # ceil(5 / 2): the last window is short
    assert [r.num_samples for r in results] == [8, 8, 4]
    assert step.num_steps == 3
    capped = list(train_epoch(step, loader, max_steps=2))
    assert [r.step for r in capped] == [4, 5]
    assert step.num_steps == 5
    assert loader.epoch == 2  # each call was one pass; the capped one ended early
    untimed = results[0]
    assert untimed.phase_s is None  # no timer given: no split
    with pytest.raises(ValueError, match="max_steps=0"):
        train_epoch(step, loader, max_steps=0)  # at the call, not at the first step


def test_a_timed_step_reports_its_phase_split():
    single = Runtime(ProcessInfo())
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    timer = ddpkit.StepTimer(single)
    step = TrainStep(model, optimizer, runtime=single, num_micro_steps=K, timer=timer)
    results = list(train_epoch(step, [_dataset(4)[:]] * 4))
    assert len(results) == 2
    for result in results:
        assert set(result.phase_s) == {"data_wait", "forward", "backward_comm", "optimizer"}
        assert all(seconds > 0 for seconds in result.phase_s.values())
    for phase, total in timer.seconds.items():  # the per-step splits add up to the epoch's
        steps_total = sum(r.phase_s[phase] for r in results)
        if phase == "data_wait":  # the epoch's also has the final look for a next window
            assert 0 < steps_total < total
        else:
            assert steps_total == pytest.approx(total, rel=1e-9)
    assert timer.num_steps == 2 and timer.num_samples == 16


def test_keyword_only_arguments_past_model_and_optimizer():
    single = Runtime(ProcessInfo())
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with pytest.raises(TypeError):
        TrainStep(model, optimizer, single)  # type: ignore[misc]
    with pytest.raises(ddpkit.ConfigError, match="num_micro_steps=0"):
        TrainStep(model, optimizer, runtime=single, num_micro_steps=0)
