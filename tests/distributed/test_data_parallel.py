"""Strategy ``dp`` (DataParallel): one process over 2+ GPUs, otherwise a clear error, never a
silent no-op. The CUDA path runs only where 2 CUDA devices exist."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.env import ProcessInfo
from ddpkit.runtime.process_group import Runtime
from ddpkit.testing import run_distributed

NUM_CUDA = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _dp_in_several_processes(runtime) -> str:
    try:
        ddpkit.wrap_model(nn.Linear(2, 2), runtime, strategy="dp")
    except ddpkit.ConfigError as exc:
        return str(exc)
    return "no error"


def test_dp_is_refused_in_a_multi_process_job():
    for message in run_distributed(_dp_in_several_processes, 2):
        assert message.startswith("strategy='dp' with world_size=2. It runs in one process.")


@pytest.mark.skipif(NUM_CUDA >= 2, reason="checks the message shown without 2 CUDA devices")
def test_dp_without_two_gpus_is_a_clear_error():
    single = Runtime(ProcessInfo())
    with pytest.raises(ddpkit.ConfigError) as info:
        ddpkit.wrap_model(nn.Linear(2, 2), single, strategy="dp")
    assert str(info.value).startswith(
        f"strategy='dp' needs 2 or more CUDA devices: found {NUM_CUDA}. Use strategy 'single'"
    )
    with pytest.raises(ddpkit.ConfigError, match=r"sync_batchnorm=True with strategy='dp'\. These"):
        ddpkit.wrap_model(nn.Linear(2, 2), single, strategy="dp", sync_batchnorm=True)


@pytest.mark.skipif(NUM_CUDA < 2, reason="DataParallel needs 2 CUDA devices")
def test_dp_splits_the_batch_over_two_gpus(caplog):
    torch.manual_seed(0)
    reference = nn.Linear(4, 3)
    model = nn.Linear(4, 3)
    model.load_state_dict(reference.state_dict())
    runtime = Runtime(ProcessInfo(), backend="nccl", device=torch.device("cuda", 0))
    with caplog.at_level("INFO", logger="ddpkit"):
        dp_model = ddpkit.wrap_model(model, runtime, strategy="dp", device_ids=[0, 1])
    assert "PyTorch recommends DistributedDataParallel" in caplog.text
    seen = []
    dp_model.module.register_forward_hook(lambda m, i, o: seen.append(i[0].device))
    x = torch.randn(8, 4)
    dp_model(x.cuda(0)).square().sum().backward()
    reference(x).square().sum().backward()
    assert sorted(str(d) for d in seen) == ["cuda:0", "cuda:1"]  # one half per device
    torch.testing.assert_close(model.weight.grad.cpu(), reference.weight.grad)
