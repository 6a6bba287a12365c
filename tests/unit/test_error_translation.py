"""The classic distributed failures, each caused for real, each given one line with the fix."""

from __future__ import annotations

import os
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DistributedSampler

import ddpkit
from ddpkit.diagnostics.translate import check_start_method, explain
from ddpkit.distributed.env import ProcessInfo
from ddpkit.testing import run_distributed

RANK_1_OF_2 = ProcessInfo(rank=1, local_rank=1, world_size=2, local_world_size=2, source="torchrun")
RANK_0_OF_2 = ProcessInfo(rank=0, local_rank=0, world_size=2, local_world_size=2, source="torchrun")


@pytest.fixture
def loopback_socket(monkeypatch):
    """A socket bound to a loopback port that this test owns; MASTER_* point at it."""
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(sock.getsockname()[1]))
    yield sock
    sock.close()


def test_master_unreachable_names_address_port_and_what_to_check(loopback_socket):
    port = loopback_socket.getsockname()[1]  # bound, not listening: connections are refused
    with pytest.raises(ddpkit.DistributedError) as caught:
        ddpkit.init_runtime("gloo", init_timeout_s=1, info=RANK_1_OF_2)
    message = str(caught.value)
    assert f"cannot reach the rendezvous store at 127.0.0.1:{port}" in message
    assert "rank 0 is running" in message and "firewall" in message
    assert "\n" not in message


def test_port_in_use_names_the_port_and_the_fix(loopback_socket):
    loopback_socket.listen()
    port = loopback_socket.getsockname()[1]
    with pytest.raises(ddpkit.ConfigError) as caught:
        ddpkit.init_runtime("gloo", init_timeout_s=5, info=RANK_0_OF_2)
    message = str(caught.value)
    assert f"port {port} on 127.0.0.1 is already in use" in message
    assert "ddpkit run" in message and "\n" not in message
    assert not dist.is_initialized()


def test_process_group_not_initialised_is_explained():
    with pytest.raises(ValueError) as caught:
        DistributedSampler(list(range(10)))  # the classic: sampler built before init
    assert explain(caught.value).startswith("torch.distributed was used before the process group")
    assert "ddpkit.init_runtime()" in explain(caught.value)


def test_nccl_and_cuda_where_there_are_none_are_explained():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    with pytest.raises(RuntimeError) as nccl:
        dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    assert "--backend gloo" in explain(nccl.value)
    with pytest.raises((AssertionError, RuntimeError)) as cuda:
        torch.zeros(1, device="cuda")
    assert "gloo" in explain(cuda.value)
    with pytest.raises(ddpkit.ConfigError, match="backend=nccl needs one CUDA device"):
        ddpkit.init_runtime("nccl", info=ProcessInfo())


def test_explain_follows_the_cause_chain_and_knows_its_limits():
    try:
        try:
            raise ValueError("Default process group has not been initialized, please ...")
        except ValueError as inner:
            raise RuntimeError("building the model failed") from inner
    except RuntimeError as outer:
        assert explain(outer) is not None
    assert explain(ValueError("something else")) is None


def test_wrapping_twice_is_refused():
    model = ddpkit.wrap_model(nn.Linear(2, 2), ddpkit.init_runtime("gloo", info=ProcessInfo()))
    with pytest.raises(ddpkit.ConfigError, match="already wrapped"):
        ddpkit.wrap_model(nn.DataParallel(model), ddpkit.init_runtime("gloo", info=ProcessInfo()))


def _never_runs(runtime):
    raise AssertionError("no worker may start")


def test_fork_after_cuda_init_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # the condition, simulated
    with pytest.raises(ddpkit.ConfigError, match="refusing to fork workers: CUDA is already"):
        run_distributed(_never_runs, world_size=2, start_method="fork")
    check_start_method("spawn")  # spawn stays safe
    with pytest.raises(ddpkit.ConfigError, match="unknown start method"):
        check_start_method("thread")
