"""Gradient communication options: compression hooks really cut the bytes, buckets follow the cap.

Bytes are counted by ddpkit's wrapping hooks; the expected figures are computed here from the
parameter shapes (and, for PowerSGD, from its documented rule), never copied from a run.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ddpkit
from ddpkit.parallel.comm import CommStats
from ddpkit.testing import run_distributed

NUM_STEPS = 4
POWERSGD_START = 2
POWERSGD_RANK = 1
SHAPES = [(64, 32), (64,), (16, 64), (16,)]  # the parameters of _net(), in order


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(8, 32, generator=gen) * (rank + 1), torch.randn(8, 16, generator=gen)


def _train(runtime, compression: str, **kwargs) -> dict:
    stats = CommStats()
    model = ddpkit.wrap_model(
        _net(),
        runtime,
        strategy="ddp",
        grad_compression=compression,
        comm_stats=stats,
        powersgd_rank=POWERSGD_RANK,
        powersgd_start_step=POWERSGD_START,
        **kwargs,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    bytes_per_step, grads = [], []
    for step in range(1, NUM_STEPS + 1):
        optimizer.zero_grad()
        x, y = _batch(runtime.rank, step)
        before = stats.grad_bytes
        F.mse_loss(model(x), y).backward()
        bytes_per_step.append(stats.grad_bytes - before)
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        optimizer.step()
    return {
        "bytes": bytes_per_step,
        "syncs": stats.num_grad_syncs,
        "grads": grads,
        "params": [p.detach().clone() for p in model.parameters()],
    }


def _compression_rank(runtime) -> dict:
    results = {c: _train(runtime, c) for c in ("none", "fp16", "bf16", "powersgd")}
    # torch's PowerSGD callbacks hold the process group and are released by a gloo thread once
    # it gets the GIL; a group destroyed before that is freed on that thread, which then joins
    # itself ("Resource deadlock avoided"). A blocking collective first lets it finish.
    ddpkit.barrier(runtime)
    return results


def _powersgd_numel(shapes, rank: int, min_compression_rate: float = 2.0) -> int:
    """Elements PowerSGD all-reduces per step, by its documented rule: a tensor viewed as an
    (n, m) matrix, m = numel / n, is sent as P (n x r) and Q (m x r), r = min(n, m, rank), when
    (n + m) r * min_compression_rate < n m; otherwise it is sent whole."""
    total = 0
    for shape in shapes:
        n = shape[0]
        m = int(torch.Size(shape).numel()) // n
        r = min(n, m, rank)
        total += (n + m) * r if (n + m) * r * min_compression_rate < n * m else n * m
    return total


def test_compression_cuts_bytes_by_the_expected_factor():
    results = run_distributed(_compression_rank, 2, timeout_s=120)
    numel = sum(int(torch.Size(s).numel()) for s in SHAPES)
    full = 4 * numel  # float32 gradients
    compressed = 4 * _powersgd_numel(SHAPES, POWERSGD_RANK)
    expected = {
        "none": [full] * NUM_STEPS,
        "fp16": [full // 2] * NUM_STEPS,
        "bf16": [full // 2] * NUM_STEPS,
        "powersgd": [full] * POWERSGD_START + [compressed] * (NUM_STEPS - POWERSGD_START),
    }
    assert compressed == 4 * (96 + 64 + 80 + 16)  # the biases go uncompressed: 12.3x overall
    for rank, per_compression in enumerate(results):
        for name, result in per_compression.items():
            assert result["bytes"] == expected[name], (rank, name)
            assert result["syncs"] == NUM_STEPS
            for mine, rank0 in zip(result["params"], results[0][name]["params"], strict=True):
                assert torch.equal(mine, rank0), f"{name}: rank {rank} diverged"
        plain = per_compression["none"]["grads"][0]
        # casts round the averaged gradients to 16 bits: close to the float32 average, not equal
        for name, rtol in (("fp16", 2e-3), ("bf16", 1e-2)):
            cast = per_compression[name]["grads"][0]
            for a, b in zip(cast, plain, strict=True):
                torch.testing.assert_close(a, b, rtol=rtol, atol=1e-4)
            assert not all(torch.equal(a, b) for a, b in zip(cast, plain, strict=True))
        # PowerSGD: plain average before start_powerSGD_iter, a rank-1 gradient after it
        powersgd = per_compression["powersgd"]["grads"]
        assert all(torch.equal(a, b) for a, b in zip(powersgd[0], plain, strict=True))
        for weight in (powersgd[2][0], powersgd[2][2]):
            assert int(torch.linalg.matrix_rank(weight)) == POWERSGD_RANK
        assert int(torch.linalg.matrix_rank(per_compression["none"]["grads"][2][0])) > 1


def _bucket_rank(runtime) -> dict:
    out = {}
    for name, kwargs in {
        "builtin": {"comm_stats": None},  # no hook: DDP's own all-reduce
        "default": {},
        "tiny_cap": {"bucket_cap_mb": 1e-6},  # every tensor fills a bucket by itself
        "view": {"gradient_as_bucket_view": True},
    }.items():
        stats = CommStats()
        model = ddpkit.wrap_model(
            _net(), runtime, strategy="ddp", **{"comm_stats": stats, **kwargs}
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(1, 3):  # DDP rebuilds its buckets after the first pass
            optimizer.zero_grad()
            x, y = _batch(runtime.rank, step)
            F.mse_loss(model(x), y).backward()
            optimizer.step()
        storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
        out[name] = {
            "buckets": stats.num_buckets,
            "bytes": stats.grad_bytes,
            "grad_storages": len(storages),
            "params": [p.detach().clone() for p in model.parameters()],
        }
    return out


def _big_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 600), nn.ReLU(), nn.Linear(600, 600))  # 2.55 MiB


def _powersgd_buckets(runtime) -> dict:
    """PowerSGD on a model whose gradients need two buckets at DDP's default caps."""
    out = {}
    for name in ("none", "powersgd"):
        stats = CommStats()
        model = ddpkit.wrap_model(
            _big_net(),
            runtime,
            strategy="ddp",
            grad_compression=name,
            comm_stats=stats,
            powersgd_start_step=2,
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(1, 5):  # two plain steps, then two compressed ones
            optimizer.zero_grad()
            x = torch.randn(8, 512, generator=torch.Generator().manual_seed(runtime.rank + step))
            model(x).square().mean().backward()
            optimizer.step()
        out[name] = (stats.num_buckets, [p.detach().clone() for p in model.parameters()])
    ddpkit.barrier(runtime)  # see _compression_rank
    return out


def test_powersgd_on_gloo_gets_one_bucket():
    results = run_distributed(_powersgd_buckets, 2, timeout_s=120)
    for result in results:
        assert result["none"][0] == 2  # DDP's first bucket (1 MiB) holds the last layer only
        assert result["powersgd"][0] == 1  # ddpkit's cap: P/Q all-reduces cannot interleave
        for mine, rank0 in zip(result["powersgd"][1], results[0]["powersgd"][1], strict=True):
            assert torch.equal(mine, rank0)


def test_powersgd_with_a_small_explicit_bucket_cap_is_refused():
    from ddpkit.env import ProcessInfo
    from ddpkit.parallel.comm import powersgd_bucket_cap_mb
    from ddpkit.runtime.process_group import Runtime

    gloo = Runtime(ProcessInfo(), backend="gloo", device=torch.device("cpu"))
    with pytest.raises(ddpkit.ConfigError, match="needs every gradient in one DDP bucket"):
        powersgd_bucket_cap_mb(_big_net(), gloo, {"bucket_cap_mb": 1})
    assert powersgd_bucket_cap_mb(_big_net(), gloo, {}) == {"bucket_cap_mb": 4}


def test_bucket_cap_and_gradient_as_bucket_view():
    results = run_distributed(_bucket_rank, 2, timeout_s=120)
    numel = sum(int(torch.Size(s).numel()) for s in SHAPES)
    for result in results:
        assert result["default"]["buckets"] == 1  # 12.6 kB fit DDP's first 1 MiB bucket
        assert result["tiny_cap"]["buckets"] == len(SHAPES)
        # the same bytes either way; only their grouping changes
        assert result["default"]["bytes"] == result["tiny_cap"]["bytes"] == 2 * 4 * numel
        # gradients as views of the one bucket: one storage; without: one per parameter
        assert result["view"]["grad_storages"] == 1
        assert result["default"]["grad_storages"] == len(SHAPES)
        assert result["builtin"]["bytes"] == 0  # nothing registered, nothing counted
        for name in ("builtin", "tiny_cap", "view"):  # ddpkit's counting hook changes nothing
            for a, b in zip(result[name]["params"], result["default"]["params"], strict=True):
                assert torch.equal(a, b), name


def test_bad_compression_is_a_config_error():
    from ddpkit.env import ProcessInfo
    from ddpkit.runtime.process_group import Runtime

    single = Runtime(ProcessInfo())
    with pytest.raises(ddpkit.ConfigError, match="grad_compression='int8' is not one of"):
        ddpkit.wrap_model(_net(), single, grad_compression="int8")
    with pytest.raises(
        ddpkit.ConfigError, match=r"grad_compression='fp16' with strategy='single'\. These"
    ):
        ddpkit.wrap_model(_net(), single, strategy="single", grad_compression="fp16")
    with pytest.raises(ddpkit.ConfigError, match="powersgd_start_step=1 must be an integer >= 2"):
        ddpkit.wrap_model(_net(), single, grad_compression="powersgd", powersgd_start_step=1)


def _train_wrap_hook_free(runtime, compression: str) -> tuple[bool, int]:
    """Wrap as ``ddpkit train`` does; can a comm hook still be registered (torch allows one)?"""
    from ddpkit.app.mnist.config import TrainConfig
    from ddpkit.app.mnist.job import build_model_and_optimizer

    config = TrainConfig(grad_compression=compression)
    model, _, _, stats = build_model_and_optimizer(config, runtime)
    try:
        model.register_comm_hook(None, lambda state, bucket: None)
    except RuntimeError:
        return False, stats.builtin_sync_bytes
    return True, stats.builtin_sync_bytes


def test_train_default_keeps_ddp_builtin_allreduce():
    """At default settings ddpkit train adds no Python comm hook (the raw-DDP C++ path) and
    counts the bytes per synced step instead; with compression its counting hook is there."""
    from ddpkit.app.mnist.model import MnistCNN

    grad_bytes = sum(p.numel() * p.element_size() for p in MnistCNN().parameters())
    for compression, expected in (("none", (True, grad_bytes)), ("fp16", (False, 0))):
        results = run_distributed(_train_wrap_hook_free, 2, args=(compression,), timeout_s=90)
        assert results == [expected, expected], compression
