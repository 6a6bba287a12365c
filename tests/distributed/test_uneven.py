"""Uneven inputs never hang: with Join the job completes (with Join's semantics); without it,
the ranks' batch counts are compared first and the job fails at once naming both counts."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ddpkit
from ddpkit.testing import DistributedTestError, run_distributed
from ddpkit.training.uneven import join_uneven_inputs, verify_even_batches

LR = 0.1
NUM_BATCHES = {0: 5, 1: 4}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [
        (torch.randn(4, 6, generator=gen), torch.randint(0, 3, (4,), generator=gen))
        for _ in range(NUM_BATCHES[rank])
    ]


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in ddpkit.unwrap_model(model).parameters()])


def _train_rank(runtime, use_join: bool):
    model = ddpkit.wrap_model(_net(), runtime)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    batches = _batches(runtime.rank)
    if not use_join:
        verify_even_batches(len(batches), runtime)
    num_steps = 0
    with join_uneven_inputs(model, runtime, enable=use_join):
        for x, y in batches:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            num_steps += 1
    return num_steps, _flat(model)


def _reference() -> torch.Tensor:
    """Join's semantics by hand: 4 steps on both ranks' mean gradient, then a 5th step on rank
    0's gradient divided by the full world size (rank 1 has joined and contributes zeros)."""
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    batches = {rank: _batches(rank) for rank in (0, 1)}
    for step in range(5):
        optimizer.zero_grad()
        ranks = (0, 1) if step < 4 else (0,)
        loss = sum(F.cross_entropy(model(batches[r][step][0]), batches[r][step][1]) for r in ranks)
        (loss / 2).backward()
        optimizer.step()
    return _flat(model)


def test_join_completes_uneven_inputs_with_joins_semantics():
    (steps0, params0), (steps1, params1) = run_distributed(_train_rank, 2, args=(True,))
    assert (steps0, steps1) == (5, 4)
    assert torch.equal(params0, params1)  # Join syncs the final model from the last joiner
    torch.testing.assert_close(params0, _reference(), rtol=0, atol=1e-6)


def test_without_join_uneven_inputs_fail_fast_naming_both_counts():
    # a hang would end in the harness timeout (45 s, below the 120 s collective timeout)
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_train_rank, 2, args=(False,), timeout_s=45, pg_timeout_s=120)
    # both ranks raise; the harness kills the other rank on the first failure it sees, so one
    # or both tracebacks are reported, and each names both counts and the fix
    error = info.value
    assert error.header in ("1 of 2 rank(s) failed", "2 of 2 rank(s) failed"), error.header
    assert error.failures
    for text in error.failures.values():
        assert "uneven inputs: rank 0 has 5 batches, rank 1 has 4 batches" in text
        assert "ddpkit train --join" in text
