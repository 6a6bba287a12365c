"""``wrap_model(compile=...)`` in one process: validated arguments, refusals in one line,
compiled in place (no ``_orig_mod.``), and the gradient check's nesting rule.

On real ranks (compiled vs eager, the check catching unsynced gradients, checkpoints, guards):
tests/distributed/test_compile.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import ddpkit
from ddpkit.app.mnist.config import TrainConfig, check
from ddpkit.env import ProcessInfo
from ddpkit.guards import grad_sync
from ddpkit.parallel.compile import compile_wrapped, prepare_compile
from ddpkit.parallel.strategy import DDP, FSDP, DataParallel, Live, Single, ZeRO1
from ddpkit.runtime.process_group import Runtime

SINGLE = Runtime(ProcessInfo())


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


def test_compile_at_one_process_is_in_place_with_plain_keys(caplog):
    graphs = []

    def counting_backend(gm, example_inputs):  # a torch.compile backend that runs the graph
        graphs.append(gm)
        return gm.forward

    net = Net()
    with caplog.at_level(logging.INFO, logger="ddpkit"):
        model = ddpkit.wrap_model(net, SINGLE, compile={"backend": counting_backend})
    assert model is net and type(model) is Net  # no OptimizedModule around it
    assert list(model.state_dict()) == ["fc.weight", "fc.bias"]
    x = torch.randn(4, 3)
    model(x).sum().backward()
    assert len(graphs) == 1  # the forward went through torch.compile
    assert torch.equal(model(x), torch.relu(net.fc(x)))
    lines = [r.getMessage() for r in caplog.records if r.name == "ddpkit.parallel"]
    assert any("Net compiled in place with torch.compile(backend=" in line for line in lines)


@pytest.mark.parametrize(
    "compile_,expected",
    [
        ("yes", "invalid compile: compile='yes'. Use True, False or a dict of torch.compile"),
        ({"mdoe": "max-autotune"}, "unknown torch.compile option for wrap_model: mdoe."),
    ],
)
def test_bad_compile_values_are_refused(compile_, expected):
    with pytest.raises(ddpkit.ConfigError) as info:
        ddpkit.wrap_model(Net(), SINGLE, compile=compile_)
    assert str(info.value).startswith(expected)


@pytest.mark.parametrize(
    "strategy,compile_,steps,expected",
    [
        (DataParallel(), True, None, "compile=True with strategy='dp'. DataParallel replicates"),
        (DDP(bucket_cap_mb=0.5), True, None, "compile=True with bucket_cap_mb=0.5. torch"),
        (DDP(), True, -1, "invalid grad_sync_check_steps=-1. It counts optimizer steps"),
        (FSDP(), True, 3, "grad_sync_check_steps=3 with strategy='fsdp': the check"),
    ],
)
def test_what_compile_cannot_do_is_refused_in_one_line(strategy, compile_, steps, expected):
    with pytest.raises(ddpkit.ConfigError) as info:
        prepare_compile(strategy, compile_, steps)
    assert str(info.value).startswith(expected)
    assert "\n" not in str(info.value)


def test_the_check_is_on_by_default_only_under_compile_with_ddp():
    assert prepare_compile(DDP(), True, None) == ({}, 3)
    assert prepare_compile(DDP(), {"mode": "max-autotune"}, None) == ({"mode": "max-autotune"}, 3)
    assert prepare_compile(DDP(), False, None) == (None, 0)
    assert prepare_compile(DDP(), False, 2) == (None, 2)  # eager DDP may ask for it
    assert prepare_compile(ZeRO1(), True, None) == ({}, 3)
    assert prepare_compile(Single(), True, None) == ({}, 0)
    assert prepare_compile(FSDP(), True, None) == ({}, 0)
    assert prepare_compile(DDP(bucket_cap_mb=1), True, None) == ({}, 3)
    assert prepare_compile(Live(), False, 3) == (None, 0)  # live ignores it, as it always did


class _DdpLike(nn.Module):
    """Stands in for a DistributedDataParallel: a ``module`` attribute (never called here)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def test_a_torch_sequential_under_ddp_is_said_not_to_compile(caplog):
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        compile_wrapped(_DdpLike(nn.Sequential(nn.Linear(2, 2))), DDP(), {"backend": "eager"})
        compile_wrapped(_DdpLike(Net()), DDP(), {"backend": "eager"})
    (line,) = [r.getMessage() for r in caplog.records if r.name == "ddpkit.parallel"]
    assert "the model is torch's own Sequential, whose forward dynamo skips under DDP" in line


class _Outer(torch.optim.Optimizer):
    """An optimizer whose step runs another's (as ZeroRedundancyOptimizer's does)."""

    def __init__(self, params) -> None:
        params = list(params)
        super().__init__(params, {})
        self.inner = torch.optim.SGD(params, lr=0.1)

    def step(self, closure=None):
        return self.inner.step()


def test_a_step_called_by_another_optimizers_step_counts_as_nested():
    seen = []
    handle = register_optimizer_step_pre_hook(
        lambda opt, args, kwargs: seen.append((type(opt).__name__, grad_sync._nested_step()))
    )
    try:
        param = nn.Parameter(torch.ones(2))
        param.grad = torch.ones(2)
        _Outer([param]).step()
        torch.optim.SGD([param], lr=0.1).step()
    finally:
        handle.remove()
    assert seen == [("_Outer", False), ("SGD", True), ("SGD", False)]


def test_the_check_does_nothing_at_one_process():
    check = grad_sync.GradSyncCheck(Net(), SINGLE, num_steps=3).attach()
    assert not check.attached and not grad_sync._HOOK


@pytest.mark.parametrize(
    "fields,expected",
    [
        ({"compile": True, "strategy": "dp"}, "compile=True with strategy='dp'. DataParallel"),
        ({"compile": True, "bucket_cap_mb": 0.5}, "compile=True with bucket_cap_mb=0.5. torch"),
        ({"compile_backend": "eager"}, "compile_backend='eager' without compile=True."),
    ],
)
def test_the_train_config_refuses_compile_where_it_cannot_work(fields, expected):
    with pytest.raises(ddpkit.ConfigError, match="invalid config: ") as info:
        check(TrainConfig(**fields))
    assert expected in str(info.value)
