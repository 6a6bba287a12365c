"""DDP through ddpkit computes what one process computes: world-size equivalence, exact evaluation.

Each spawn checks several facts, to keep the suite inside its time budget on two cores.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddpkit
from ddpkit.env import ProcessInfo
from ddpkit.runtime.process_group import Runtime
from ddpkit.testing import run_distributed

NUM_STEPS = 20
PER_RANK_BATCH = 4


def _dataset(num_samples: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(num_samples, 6, generator=gen)
    y = torch.randint(0, 3, (num_samples,), generator=gen)
    return TensorDataset(x, y)


def _train(runtime: Runtime, batch_size: int, num_samples: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = ddpkit.wrap_model(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)), runtime)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = ddpkit.build_train_loader(
        _dataset(num_samples), runtime, batch_size=batch_size, seed=7
    )
    step = 0
    while step < NUM_STEPS:  # crosses an epoch boundary: the sampler epoch must advance alike
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            step += 1
            if step == NUM_STEPS:
                break
    return {k: v.detach().clone() for k, v in ddpkit.model_state_dict(model).items()}


def _train_rank(runtime: Runtime, num_samples: int) -> dict[str, torch.Tensor]:
    return _train(runtime, PER_RANK_BATCH, num_samples)


@pytest.mark.parametrize("world_size", [2, 3])
def test_world_size_equivalence(world_size):
    # 12 steps per epoch at every world size, so 20 steps cross one epoch boundary.
    num_samples = 12 * PER_RANK_BATCH * world_size
    single = Runtime(ProcessInfo())
    reference = _train(single, PER_RANK_BATCH * world_size, num_samples)
    per_rank = run_distributed(_train_rank, world_size, args=(num_samples,))
    for rank, params in enumerate(per_rank):
        assert params.keys() == reference.keys()
        for name, value in params.items():
            # replicas are identical; and equal to one process with the global batch
            assert torch.equal(value, per_rank[0][name]), f"rank {rank} differs in {name}"
            torch.testing.assert_close(value, reference[name], rtol=0, atol=1e-5)
    # the run really trained: parameters moved away from their initial values
    torch.manual_seed(0)
    initial = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).state_dict()
    assert (per_rank[0]["0.weight"] - initial["0.weight"]).abs().max() > 1e-3


class _OnlyFirstCorrect(nn.Module):
    """Logits that pick the true class (0) for the input 0.0 only, class 1 for every other."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        is_first = (x[:, 0] == 0).float()
        return torch.stack([is_first, 1 - is_first], dim=1)


def _eval_rank(runtime: Runtime) -> tuple[dict, float]:
    data = TensorDataset(
        torch.arange(5, dtype=torch.float32).unsqueeze(1), torch.zeros(5, dtype=torch.long)
    )
    exact = ddpkit.evaluate(
        _OnlyFirstCorrect(), ddpkit.build_eval_loader(data, runtime, batch_size=2), runtime
    )
    # what a padded DistributedSampler would report: sample 0 is repeated on the last rank
    padded = DataLoader(
        data,
        batch_size=2,
        sampler=DistributedSampler(data, runtime.world_size, runtime.rank, shuffle=False),
    )
    correct = sum(int(x[:, 0].eq(0).sum()) for x, _ in padded)
    count = sum(len(x) for x, _ in padded)
    totals = ddpkit.all_reduce_sum([correct, count], runtime).tolist()
    return exact, totals[0] / totals[1]


@pytest.mark.parametrize("world_size,padded_accuracy", [(2, 2 / 6), (3, 2 / 6)])
def test_evaluation_counts_each_sample_once(world_size, padded_accuracy):
    results = run_distributed(_eval_rank, world_size)
    for exact, padded in results:
        assert exact["accuracy"] == 0.2
        assert exact["num_samples"] == 5
        assert exact["loss"] == pytest.approx(results[0][0]["loss"])
        assert padded == pytest.approx(padded_accuracy)  # the mistake the sampler avoids


def _collective_rank(runtime: Runtime) -> tuple[list[float], str, int]:
    total = ddpkit.all_reduce_sum([runtime.rank, 1.0], runtime).tolist()
    ddpkit.barrier(runtime)
    return total, runtime.backend, runtime.world_size


def test_runtime_and_collectives_on_three_ranks():
    results = run_distributed(_collective_rank, 3)
    assert results == [([3.0, 3.0], "gloo", 3)] * 3
