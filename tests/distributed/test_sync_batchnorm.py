"""SyncBatchNorm on CPU/gloo computes what one BatchNorm computes over the concatenated batch.

Rank r's inputs are centred at 5 r, so per-rank statistics would be far from the global ones:
outputs, running statistics, input gradients and parameter gradients are compared with a
single-process model fed every rank's batch at once, on every rank.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.parallel.syncbn import CpuSyncBatchNorm
from ddpkit.testing import run_distributed

PER_RANK = 4
NUM_PASSES = 2


def _net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3), nn.Flatten(), nn.Linear(48, 4), nn.BatchNorm1d(4)
    )
    with torch.no_grad():  # non-trivial affine parameters
        for bn in (net[1], net[4]):
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    return net


def _inputs(world_size: int, num_pass: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one pass, rank r's slice centred at 5 r; and the loss weights."""
    gen = torch.Generator().manual_seed(num_pass)
    x = torch.randn(world_size * PER_RANK, 2, 4, 4, generator=gen)
    x += 5.0 * torch.arange(world_size).repeat_interleave(PER_RANK).view(-1, 1, 1, 1)
    return x, torch.randn(world_size * PER_RANK, 4, generator=gen)


def _run(model: nn.Module, world_size: int, rank: int | None, eval_forward=None) -> dict:
    """Train-mode passes and one eval pass; ``rank`` None = the whole batch in one process."""
    part = slice(None) if rank is None else slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    out = {}
    for num_pass in range(NUM_PASSES):
        model.zero_grad()
        x, weights = _inputs(world_size, num_pass)
        x = x[part].clone().requires_grad_(True)
        y = model(x)
        # the ranks' losses add up to the single-process loss
        ((y * weights[part]).sum() / (world_size * PER_RANK)).backward()
    out["y"], out["x_grad"] = y.detach(), x.grad
    out["grads"] = {n: p.grad.clone() for n, p in ddpkit.unwrap_model(model).named_parameters()}
    out["buffers"] = {n: b.clone() for n, b in ddpkit.unwrap_model(model).named_buffers()}
    model.eval()
    out["eval_y"] = (eval_forward or model)(_inputs(world_size, 99)[0][part]).detach()
    return out


def _raise_if_called(*args, **kwargs):
    raise AssertionError("SyncBatchNorm communicated in eval mode")


def _sync_bn_rank(runtime) -> dict:
    model = ddpkit.wrap_model(_net(), runtime, strategy="ddp", sync_batchnorm=True)

    def eval_forward(x: torch.Tensor) -> torch.Tensor:  # any all-reduce here fails the test
        original = torch.distributed.all_reduce
        torch.distributed.all_reduce = _raise_if_called
        try:
            return model(x)
        finally:
            torch.distributed.all_reduce = original

    result = _run(model, runtime.world_size, runtime.rank, eval_forward)
    result["converted"] = [type(m).__name__ for m in model.modules() if "Norm" in type(m).__name__]
    return result


@pytest.mark.parametrize("world_size", [2, 3])
def test_sync_batchnorm_equals_one_batchnorm_over_all_ranks(world_size):
    results = run_distributed(_sync_bn_rank, world_size, timeout_s=120)
    reference = _run(_net(), world_size, None)
    for rank, result in enumerate(results):
        part = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        assert result["converted"] == ["CpuSyncBatchNorm", "CpuSyncBatchNorm"]
        close = {"rtol": 0, "atol": 1e-5}
        torch.testing.assert_close(result["y"], reference["y"][part], **close)
        torch.testing.assert_close(result["x_grad"], reference["x_grad"][part], **close)
        torch.testing.assert_close(result["eval_y"], reference["eval_y"][part], **close)
        for name, grad in reference["grads"].items():
            # DDP averages the ranks' gradients; the single process has their sum
            torch.testing.assert_close(result["grads"][name] * world_size, grad, **close)
        for name, buffer in reference["buffers"].items():
            torch.testing.assert_close(result["buffers"][name], buffer, **close)
        assert int(result["buffers"]["1.num_batches_tracked"]) == NUM_PASSES
    # the comparison can fail: plain BatchNorm on one rank's slice is far from the reference
    local = _run(_net(), world_size, world_size - 1)
    assert (local["y"] - reference["y"][-PER_RANK:]).abs().max() > 0.1


def test_model_without_batchnorm_is_unchanged(caplog):
    from ddpkit.env import ProcessInfo
    from ddpkit.parallel.syncbn import convert_sync_batchnorm
    from ddpkit.runtime.process_group import Runtime

    runtime = Runtime(ProcessInfo())
    model = nn.Linear(2, 2)
    with caplog.at_level("INFO", logger="ddpkit"):
        assert convert_sync_batchnorm(model, runtime) is model
    assert "has no BatchNorm layer; nothing converted" in caplog.text
    assert not isinstance(_net()[1], CpuSyncBatchNorm)
