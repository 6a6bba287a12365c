"""Local SGD: replicas differ between averaging steps, are identical right after each one, and
communication drops by the period H (bytes counted per step, with and without)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ddpkit
from ddpkit.guards.nonfinite import ReplicaDivergenceError, check_replicas
from ddpkit.parallel.comm import CommStats
from ddpkit.parallel.local_sgd import enable_local_sgd
from ddpkit.testing import run_distributed
from ddpkit.training.uneven import join_uneven_inputs

SYNC_EVERY = 3
NUM_STEPS = 7
LR = 0.1


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10 * rank + step)
    return torch.randn(6, 5, generator=gen) + rank, torch.randn(6, 2, generator=gen)


def _local_sgd_rank(runtime, ddp_options: dict | None = None) -> dict:
    stats = CommStats()
    model = ddpkit.wrap_model(_net(), runtime, strategy="ddp", **(ddp_options or {}))
    optimizer = enable_local_sgd(
        model,
        torch.optim.SGD(model.parameters(), lr=LR),
        runtime=runtime,
        sync_every=SYNC_EVERY,
        comm_stats=stats,
    )
    bytes_per_step, equal_after = [], []
    for step in range(1, NUM_STEPS + 1):
        optimizer.zero_grad()
        x, y = _batch(runtime.rank, step)
        before = stats.total_bytes
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        bytes_per_step.append(stats.total_bytes - before)
        try:
            check_replicas(model, runtime, step=step)
            equal_after.append(True)
        except ReplicaDivergenceError:
            equal_after.append(False)
    ddp_stats = CommStats()  # the same steps with plain DDP, for the byte comparison
    ddp_model = ddpkit.wrap_model(_net(), runtime, strategy="ddp", comm_stats=ddp_stats)
    ddp_optimizer = torch.optim.SGD(ddp_model.parameters(), lr=LR)
    for step in range(1, NUM_STEPS + 1):
        ddp_optimizer.zero_grad()
        x, y = _batch(runtime.rank, step)
        F.mse_loss(ddp_model(x), y).backward()
        ddp_optimizer.step()
    return {
        "equal_after": equal_after,
        "bytes": bytes_per_step,
        "ddp_bytes": ddp_stats.total_bytes,
        "averager_step": optimizer.state_dict()["step"],
        "params": [p.detach().clone() for p in model.parameters()],
    }


def _reference(world_size: int) -> list[nn.Module]:
    """Local SGD simulated in one process: one model per rank, averaged every SYNC_EVERY steps."""
    replicas = [_net() for _ in range(world_size)]
    for step in range(1, NUM_STEPS + 1):
        for rank, replica in enumerate(replicas):
            replica.zero_grad()
            x, y = _batch(rank, step)
            F.mse_loss(replica(x), y).backward()
            with torch.no_grad():
                for p in replica.parameters():
                    p -= LR * p.grad
        if step % SYNC_EVERY == 0:
            with torch.no_grad():
                for params in zip(*(r.parameters() for r in replicas), strict=True):
                    mean = torch.stack(params).mean(0)
                    for p in params:
                        p.copy_(mean)
    return replicas


@pytest.mark.parametrize(
    "world_size,ddp_options",
    [
        (2, None),
        (3, None),
        # DDP's unused-parameter search changes its backward: still no gradient leaves a rank
        (2, {"find_unused_parameters": True}),
    ],
)
def test_local_sgd_replicas_agree_right_after_averaging(world_size, ddp_options):
    results = run_distributed(_local_sgd_rank, world_size, args=(ddp_options,), timeout_s=120)
    numel = sum(p.numel() for p in _net().parameters())
    averaged = [s % SYNC_EVERY == 0 for s in range(1, NUM_STEPS + 1)]
    replicas = _reference(world_size)
    for rank, result in enumerate(results):
        # identical exactly at steps 3 and 6, different at every other step
        assert result["equal_after"] == averaged
        # parameters only, once per H steps; no gradient bytes at all
        assert result["bytes"] == [4 * numel if a else 0 for a in averaged]
        assert result["ddp_bytes"] == NUM_STEPS * 4 * numel
        assert result["averager_step"] == NUM_STEPS
        # step 7 was local: each rank holds its own replica of the one-process simulation
        for mine, ref in zip(result["params"], replicas[rank].parameters(), strict=True):
            torch.testing.assert_close(mine, ref.detach(), rtol=0, atol=1e-6)
    six_steps_local = sum(results[0]["bytes"][:6])
    assert results[0]["ddp_bytes"] * 6 / NUM_STEPS / six_steps_local == SYNC_EVERY


def _local_sgd_refusals(runtime) -> list[str]:
    messages = []
    hooked = ddpkit.wrap_model(_net(), runtime, strategy="ddp", grad_compression="fp16")
    with pytest.raises(ddpkit.ConfigError) as info:
        enable_local_sgd(
            hooked, torch.optim.SGD(hooked.parameters(), lr=LR), runtime=runtime, sync_every=2
        )
    messages.append(str(info.value))
    static = ddpkit.wrap_model(_net(), runtime, strategy="ddp", static_graph=True)
    with pytest.raises(ddpkit.ConfigError) as info:
        enable_local_sgd(
            static, torch.optim.SGD(static.parameters(), lr=LR), runtime=runtime, sync_every=2
        )
    messages.append(str(info.value))
    model = ddpkit.wrap_model(_net(), runtime, strategy="ddp")
    enable_local_sgd(
        model, torch.optim.SGD(model.parameters(), lr=LR), runtime=runtime, sync_every=2
    )
    with pytest.raises(ddpkit.ConfigError) as info:
        join_uneven_inputs(model, runtime)
    messages.append(str(info.value))
    return messages


def test_a_comm_hook_static_graph_or_join_with_local_sgd_is_refused():
    hook, static, join = run_distributed(_local_sgd_refusals, 2)[0]
    assert hook.startswith("sync_every=2 with a comm hook. Local SGD sends no gradients")
    assert static.startswith("sync_every=2 with static_graph=True. DDP fails in static-graph")
    assert "drop --static-graph" in static
    assert join.startswith("join_uneven_inputs: local SGD with join=True. Join cannot stand in")
    assert "verify_even_batches" in join


def test_sync_every_below_two_is_refused():
    from ddpkit.env import ProcessInfo
    from ddpkit.runtime.process_group import Runtime

    single = Runtime(ProcessInfo())
    model = _net()
    with pytest.raises(ddpkit.ConfigError, match="sync_every=1. It must be an integer >= 2"):
        enable_local_sgd(
            model, torch.optim.SGD(model.parameters(), lr=LR), runtime=single, sync_every=1
        )
    with pytest.raises(ddpkit.ConfigError, match="needs a DistributedDataParallel model"):
        enable_local_sgd(
            model, torch.optim.SGD(model.parameters(), lr=LR), runtime=single, sync_every=2
        )
