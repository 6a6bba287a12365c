"""The classic DDP errors, caused for real on 2 ranks: each traceback ends with the fix.

The harness runs each rank inside ``init_runtime`` (as a user's script does under plain
torchrun), so the hint arrives as a note on the exception, printed under its traceback.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.testing import DistributedTestError, run_distributed


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(8, 8)
        self.fc = nn.Linear(8, 3)
        self.num_classes = 3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(checkpoint(self.block, x, use_reentrant=self.reentrant))

    reentrant = True


def _train_checkpointed(runtime, reentrant: bool) -> str:
    model = ddpkit.wrap_model(Checkpointed(), runtime, find_unused_parameters=True)
    ddpkit.unwrap_model(model).reentrant = reentrant
    for _ in range(2):
        x = torch.randn(4, 8, requires_grad=True)
        F.cross_entropy(model(x), torch.randint(0, 3, (4,))).backward()
    return "trained"


def _assert_every_failure_has(caught: DistributedTestError, *texts: str) -> None:
    assert caught.failures, caught
    for trace in caught.failures.values():
        for text in texts:
            assert text in trace, trace
        assert trace.count("ddpkit hint: ") == 1, trace


def test_reentrant_checkpointing_error_names_use_reentrant_false():
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(_train_checkpointed, world_size=2, args=(True,))
    _assert_every_failure_has(
        caught.value,
        "RuntimeError: Expected to mark a variable ready only once",  # torch's own error
        "ddpkit hint: DDP got a parameter's gradient twice in one backward. The usual cause is "
        "activation checkpointing with use_reentrant=True",
        "pass use_reentrant=False, or wrap with static_graph=True",
    )
    # the fix the hint gives works
    assert run_distributed(_train_checkpointed, world_size=2, args=(False,)) == ["trained"] * 2


def _attribute_through_wrapper(runtime) -> int:
    model = ddpkit.wrap_model(Checkpointed(), runtime)
    assert ddpkit.unwrap_model(model).num_classes == 3  # the fix the hint gives
    return model.num_classes


def test_attribute_through_the_wrapper_names_unwrap_model():
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(_attribute_through_wrapper, world_size=2)
    _assert_every_failure_has(
        caught.value,
        "AttributeError: 'DistributedDataParallel' object has no attribute 'num_classes'",
        "ddpkit hint: DDP wraps your model: its own attributes and methods live on the module "
        "inside. Use ddpkit.unwrap_model(model).num_classes, which works at every world size "
        "(at 1 process ddpkit.wrap_model returns the module itself, so model.num_classes only "
        "fails once scaled out).",
    )


def _batchnorm_last_batch(runtime, fix: str) -> list[int]:
    torch.manual_seed(0)
    # 10 samples, 4 per batch: batches of 4, 4, 2 in one process; per rank of 2, a shard of 5
    # samples in batches of 4 and 1
    data = TensorDataset(torch.randn(10, 8), torch.randint(0, 3, (10,)))
    net = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
    model = ddpkit.wrap_model(net, runtime, sync_batchnorm=fix == "sync_batchnorm")
    loader = ddpkit.build_train_loader(data, runtime, batch_size=4, drop_last=fix == "drop_last")
    sizes = []
    for x, y in loader:
        sizes.append(len(x))
        F.cross_entropy(model(x), y).backward()
    return sizes


def test_batch_of_one_into_batchnorm_after_sharding_names_drop_last():
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(_batchnorm_last_batch, world_size=2, args=("none",))
    _assert_every_failure_has(
        caught.value,
        "ValueError: Expected more than 1 value per channel when training, got input size "
        "torch.Size([1, 4])",
        "ddpkit hint: a batch of 1 sample reached BatchNorm in training mode: after sharding",
        "Pass drop_last=True to ddpkit.build_train_loader",
        "or use SyncBatchNorm (ddpkit.wrap_model(..., sync_batchnorm=True))",
    )
    # both fixes the hint gives work
    assert run_distributed(_batchnorm_last_batch, world_size=2, args=("drop_last",)) == [[4]] * 2
    assert (
        run_distributed(_batchnorm_last_batch, world_size=2, args=("sync_batchnorm",))
        == [[4, 1]] * 2
    )
