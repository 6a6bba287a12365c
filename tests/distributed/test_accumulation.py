"""Gradient accumulation: one all-reduce per bucket per optimizer step, and exactly the update of
one process taking the whole global batch at once (also with smaller and partial last windows).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.env import ProcessInfo
from ddpkit.runtime.process_group import Runtime
from ddpkit.testing import DistributedTestError, run_distributed
from ddpkit.training.accumulation import GradientAccumulator

PER_RANK_BATCH = 4
K = 2
# 36 samples on 2 ranks: 18 per rank = batches of 4, 4, 4, 4, 2 -> windows (4, 4), (4, 4), (2):
# a trailing window of one micro-step whose batch is smaller.
NUM_SAMPLES = 36


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(5)
    return TensorDataset(
        torch.randn(NUM_SAMPLES, 6, generator=gen),
        torch.randint(0, 3, (NUM_SAMPLES,), generator=gen),
    )


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in ddpkit.unwrap_model(model).parameters()])


class _CountingState:
    def __init__(self, process_group, accumulator=None):
        self.process_group = process_group
        self.accumulator = accumulator
        self.calls: list[tuple] = []  # (window, micro-step, bucket) of each all-reduce


def _counting_hook(state: _CountingState, bucket):
    active = state.accumulator.current_micro_step if state.accumulator is not None else None
    where = (active.window.index, active.index) if active is not None else (None, None)
    state.calls.append((*where, bucket.index()))
    return allreduce_hook(state.process_group, bucket)


def _accumulate_rank(runtime: Runtime, num_micro_steps: int):
    # a tiny bucket cap: several buckets after DDP's first iteration (which uses one large
    # first bucket, then rebuilds them)
    model = ddpkit.wrap_model(_net(), runtime, bucket_cap_mb=1e-4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = ddpkit.build_train_loader(_dataset(), runtime, batch_size=PER_RANK_BATCH, seed=3)
    accumulator = GradientAccumulator(model, runtime, num_micro_steps=num_micro_steps)
    state = _CountingState(runtime.process_group, accumulator)
    model.register_comm_hook(state, _counting_hook)
    per_step, windows = [], []
    for window in accumulator.windows(loader):
        optimizer.zero_grad(set_to_none=True)
        for micro in window:
            x, y = micro.batch
            with micro:
                micro.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        per_step.append(_flat(model))
        windows.append([micro_size for micro_size in window.sizes])
    return {"params": per_step, "calls": state.calls, "windows": windows}


def _reference() -> list[torch.Tensor]:
    """One process, no accumulation: each optimizer step takes the whole global batch."""
    single = Runtime(ProcessInfo())
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = ddpkit.build_train_loader(
        _dataset(), single, batch_size=PER_RANK_BATCH * 2 * K, seed=3
    )
    params = []
    for x, y in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        params.append(_flat(model))
    return params


def test_two_ranks_k2_equal_one_process_with_the_global_batch():
    results = run_distributed(_accumulate_rank, 2, args=(K,))
    reference = _reference()
    assert len(reference) == 3  # global batches of 16, 16 and 4
    for result in results:
        assert result["windows"] == [[4, 4], [4, 4], [2]]  # partial, smaller last window
        assert len(result["params"]) == len(reference)
        for step, (got, ref, rank0) in enumerate(
            zip(result["params"], reference, results[0]["params"], strict=True)
        ):
            assert torch.equal(got, rank0), f"ranks differ after optimizer step {step + 1}"
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
        # each bucket all-reduced exactly once per optimizer step, on the window's last
        # micro-step: buckets x optimizer steps, not x micro-steps
        calls = result["calls"]
        for index, window in enumerate(result["windows"]):
            here = [(micro, bucket) for w, micro, bucket in calls if w == index]
            assert {micro for micro, _ in here} == {len(window) - 1}
            assert sorted(bucket for _, bucket in here) == list(range(len(here)))
        per_window = [[w for w, _, _ in calls].count(i) for i in range(3)]
        assert per_window[1] == per_window[2] >= 2  # measured on torch 2.13: [1, 2, 2]
        assert len(calls) == sum(per_window)  # nothing outside the windows' last micro-steps
    # the parameters really moved
    assert (reference[-1] - _flat(_net())).abs().max() > 1e-2


def _naive_no_sync_rank(runtime: Runtime):
    """The mistake seen in the field: no_sync around backward only (forward outside)."""
    model = ddpkit.wrap_model(_net(), runtime)
    state = _CountingState(runtime.process_group)
    model.register_comm_hook(state, _counting_hook)
    batches = [(torch.randn(4, 6), torch.randint(0, 3, (4,))) for _ in range(4)]
    for i, (x, y) in enumerate(batches):
        loss = F.cross_entropy(model(x), y)
        if i < 3:
            with model.no_sync():
                loss.backward()
        else:
            loss.backward()
    naive_calls = len(state.calls)
    accumulator = GradientAccumulator(model, runtime, num_micro_steps=4)
    caught = []
    for window in accumulator.windows(batches):
        for micro in window:
            x, y = micro.batch
            try:
                loss = F.cross_entropy(model(x), y)  # forward outside the context
            except ddpkit.DistributedError as exc:
                caught.append(str(exc))
                break
        break
    return naive_calls, caught


def test_forward_outside_the_micro_step_is_refused():
    for naive_calls, caught in run_distributed(_naive_no_sync_rank, 2):
        assert naive_calls == 4  # syncs every micro-step: what the context must prevent
        assert len(caught) == 1
        assert "forward ran outside the micro-step context in window 0" in caught[0]


def _uneven_sizes_rank(runtime: Runtime):
    """Ranks whose micro-batches differ in size: the global count is all-reduced per window."""
    data = _dataset()
    sizes = {0: [(0, 5), (5, 9)], 1: [(9, 13), (13, 14)]}[runtime.rank]  # 9 + 5 = 14 samples
    batches = [(data.tensors[0][a:b], data.tensors[1][a:b]) for a, b in sizes]
    model = ddpkit.wrap_model(_net(), runtime)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    accumulator = GradientAccumulator(model, runtime, num_micro_steps=2)
    for window in accumulator.windows(batches):
        optimizer.zero_grad()
        for micro in window:
            x, y = micro.batch
            with micro:
                micro.backward(F.cross_entropy(model(x), y, reduction="sum"), reduction="sum")
        num_samples = window.num_samples
    optimizer.step()
    return _flat(model), num_samples


def test_unequal_micro_batches_are_normalised_over_the_global_count():
    results = run_distributed(_uneven_sizes_rank, 2)
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = _dataset().tensors
    F.cross_entropy(model(x[:14]), y[:14]).backward()  # the mean over all 14 samples
    optimizer.step()
    for params, num_samples in results:
        assert num_samples == 14
        torch.testing.assert_close(params, _flat(model), rtol=0, atol=1e-6)


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_invalid_num_micro_steps_is_a_config_error(value):
    single = Runtime(ProcessInfo())
    with pytest.raises(ddpkit.ConfigError, match="num_micro_steps="):
        GradientAccumulator(nn.Linear(1, 1), single, num_micro_steps=value)


def _skip_micro_step(runtime: Runtime):
    model = ddpkit.wrap_model(_net(), runtime)
    batches = [(torch.randn(2, 6), torch.randint(0, 3, (2,))) for _ in range(4)]
    for window in GradientAccumulator(model, runtime, num_micro_steps=2).windows(batches):
        for micro in window:
            with micro:
                model(micro.batch[0])  # forward, but no micro.backward
            break


def test_a_micro_step_without_backward_is_refused():
    with pytest.raises(DistributedTestError, match="ran 1 forward\\(s\\) and 0 backward"):
        run_distributed(_skip_micro_step, 2)


def test_single_process_windows_count_optimizer_steps():
    single = Runtime(ProcessInfo())
    model = _net()
    accumulator = GradientAccumulator(model, single, num_micro_steps=2)
    batches = [(torch.randn(n, 6), torch.randint(0, 3, (n,))) for n in (3, 3, 3, 3, 1)]
    shapes = []
    for window in accumulator.windows(batches):
        for micro in window:
            with micro:
                micro.backward(F.cross_entropy(model(micro.batch[0]), micro.batch[1]))
        shapes.append((window.sizes, window.num_samples))
    # the trailing partial window still steps; the LR schedule must count 3, not 5
    assert shapes == [([3, 3], 6), ([3, 3], 6), ([1], 1)]
    assert accumulator.num_optimizer_steps(len(batches)) == len(shapes) == 3
