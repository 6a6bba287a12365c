"""Mixed precision: fp16 loss scaling clips unscaled gradients once, every rank skips together,
ranks with different scales are refused, and the checkpoint keeps the scale."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ddpkit
from ddpkit.env import ProcessInfo
from ddpkit.runtime.process_group import Runtime
from ddpkit.testing import DistributedTestError, run_distributed
from ddpkit.training.accumulation import GradientAccumulator
from ddpkit.training.precision import MixedPrecision

LR = 0.4
MAX_NORM = 0.25  # below the gradient norm (about 0.94), so clipping acts


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10 + rank)
    return 4 * torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in ddpkit.unwrap_model(model).parameters()])


def _fp16_step_rank(runtime: Runtime, directory: str):
    model = ddpkit.wrap_model(_net(), runtime)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    precision = MixedPrecision("16-mixed", runtime, init_scale=65536.0, growth_interval=1)
    accumulator = GradientAccumulator(model, runtime, num_micro_steps=1, precision=precision)
    before = _flat(model)
    for window in accumulator.windows([_batch(runtime.rank)]):
        for micro in window:
            x, y = micro.batch
            with micro:
                logits = model(x)
                dtype = logits.dtype
                micro.backward(F.cross_entropy(logits, y))
        result = precision.step(optimizer, model, max_norm=MAX_NORM)
    scale_after = precision.scaler.get_scale()
    state = {"model": model, "scaler": precision.scaler}
    ddpkit.CheckpointManager(directory, runtime, state=state).save(1)
    fresh = MixedPrecision("16-mixed", runtime, init_scale=2.0)
    state = {"model": model, "scaler": fresh.scaler}
    ddpkit.CheckpointManager(directory, runtime, state=state).resume()
    return {
        "update": _flat(model) - before,
        "grad_norm": result.grad_norm,
        "stepped": result.stepped,
        "dtype": str(dtype),
        "scale_after": scale_after,
        "resumed_scale": fresh.scaler.get_scale(),
    }


def _fp32_reference() -> tuple[torch.Tensor, float]:
    """One fp32 process on both ranks' samples: the mean gradient, clipped to MAX_NORM."""
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x = torch.cat([_batch(0)[0], _batch(1)[0]])
    y = torch.cat([_batch(0)[1], _batch(1)[1]])
    before = _flat(model)
    F.cross_entropy(model(x), y).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
    optimizer.step()
    return _flat(model) - before, norm


def _precision_rank(runtime: Runtime, directory: str) -> dict:
    """The fp16, overflow and bf16 checks in one spawn, to keep the suite short."""
    return {
        "fp16": _fp16_step_rank(runtime, directory),
        "overflow": _overflow_on_one_rank(runtime),
        "bf16": _bf16_rank(runtime),
    }


@pytest.fixture(scope="module")
def precision_results(tmp_path_factory) -> list[dict]:
    directory = tmp_path_factory.mktemp("precision-ckpt")
    return run_distributed(_precision_rank, 2, args=(str(directory),))


def test_fp16_step_at_scale_65536_with_clipping_equals_the_fp32_step(precision_results):
    results = [r["fp16"] for r in precision_results]
    ref_update, ref_norm = _fp32_reference()
    assert ref_norm > 2 * MAX_NORM  # clipping really acts
    assert ref_update.norm() == pytest.approx(LR * MAX_NORM, rel=1e-4)
    for result in results:
        assert result["dtype"] == "torch.float16"  # autocast ran the forward in fp16
        assert result["stepped"]
        # the reported norm is the unscaled one (scaled, it would be 65536 times larger)
        assert result["grad_norm"] == pytest.approx(ref_norm, rel=1e-2)
        # within fp16's rounding: 1% of the update (clipping the scaled gradients instead would
        # shrink the update 65536-fold, a 100% difference)
        assert (result["update"] - ref_update).norm() < 0.01 * ref_update.norm()
        assert torch.equal(result["update"], results[0]["update"])
        assert result["scale_after"] == 131072.0  # no overflow: grew after growth_interval=1
        assert result["resumed_scale"] == 131072.0  # the checkpoint restored the scaler


def _overflow_on_one_rank(runtime: Runtime):
    """A plain module (no DDP), so only rank 1's gradients overflow: both ranks must skip."""
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    precision = MixedPrecision("16-mixed", runtime, init_scale=1024.0)
    x, y = _batch(runtime.rank)
    before = _flat(model)
    with precision.autocast():
        loss = F.cross_entropy(model(x), y)
    if runtime.rank == 1:
        loss = loss * float("inf")
    precision.scale_loss(loss).backward()
    result = precision.step(optimizer, model)
    return result.stepped, precision.scaler.get_scale(), torch.equal(_flat(model), before)


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(precision_results):
    assert [r["overflow"] for r in precision_results] == [(False, 512.0, True)] * 2


def _different_scales(runtime: Runtime):
    model = ddpkit.wrap_model(_net(), runtime)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    precision = MixedPrecision("16-mixed", runtime, init_scale=[65536.0, 1024.0][runtime.rank])
    x, y = _batch(runtime.rank)
    with precision.autocast():
        loss = F.cross_entropy(model(x), y)
    precision.scale_loss(loss).backward()
    precision.step(optimizer, model)


def test_ranks_with_different_loss_scales_are_refused():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_different_scales, 2)
    # every rank raises; the harness reports the first failure(s) it sees and kills the rest
    error = info.value
    assert error.header in ("1 of 2 rank(s) failed", "2 of 2 rank(s) failed"), error.header
    assert error.failures
    for text in error.failures.values():
        assert "loss scale differs across ranks: rank 0 65536, rank 1 1024" in text


def _bf16_rank(runtime: Runtime):
    model = ddpkit.wrap_model(_net(), runtime)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    precision = MixedPrecision("bf16-mixed", runtime)
    before = _flat(model)
    for window in GradientAccumulator(
        model, runtime, num_micro_steps=1, precision=precision
    ).windows([_batch(runtime.rank)]):
        for micro in window:
            with micro:
                logits = model(micro.batch[0])
                micro.backward(F.cross_entropy(logits, micro.batch[1]))
        result = precision.step(optimizer, model, max_norm=MAX_NORM)
    return _flat(model) - before, result.grad_norm, str(logits.dtype), precision.scaler


def test_bf16_step_is_close_to_fp32_without_a_scaler(precision_results):
    results = [r["bf16"] for r in precision_results]
    ref_update, ref_norm = _fp32_reference()
    for update, grad_norm, dtype, scaler in results:
        assert dtype == "torch.bfloat16" and scaler is None
        assert grad_norm == pytest.approx(ref_norm, rel=0.05)
        assert (update - ref_update).norm() < 0.05 * ref_update.norm()  # bf16: 8-bit mantissa


def test_unknown_precision_is_a_config_error():
    single = Runtime(ProcessInfo())
    with pytest.raises(ddpkit.ConfigError, match="unknown precision: precision='fp8'"):
        MixedPrecision("fp8", single)
