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
from ddpkit.diagnostics.translate import add_hint_note, check_start_method, explain
from ddpkit.env import ProcessInfo
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


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.num_classes = 2


def test_module_attribute_at_one_process_is_explained(caplog):
    runtime = ddpkit.init_runtime("gloo", info=ProcessInfo())
    with caplog.at_level("INFO", logger="ddpkit"):
        model = ddpkit.wrap_model(_Net(), runtime)
    assert "world_size=1, so the module itself is returned" in caplog.text
    assert "ddpkit.unwrap_model(model).x, which also works under DDP" in caplog.text
    with pytest.raises(AttributeError) as caught:
        model.module.num_classes  # noqa: B018 - the DDP-only spelling, at 1 process
    assert str(caught.value) == "'_Net' object has no attribute 'module'"  # torch's own error
    assert (
        "at world size 1 it returns the module itself (no DDP wrapper, so no .module). "
        "Use ddpkit.unwrap_model(model)" in explain(caught.value)
    )
    assert ddpkit.unwrap_model(model).num_classes == 2


def test_batch_of_one_into_batchnorm_is_explained():
    with pytest.raises(ValueError) as caught:
        nn.BatchNorm1d(4)(torch.randn(1, 4))
    assert explain(caught.value).startswith("a batch of 1 sample reached BatchNorm")


def test_a_state_dict_saved_with_or_without_the_ddp_prefix_is_explained():
    # saved as model.state_dict() of DDP at 2 processes, loaded at 1 (wrap_model returns the
    # bare module there), and the other way round: torch's own load_state_dict errors
    bare = nn.Linear(2, 2)
    prefixed = {f"module.{k}": v for k, v in bare.state_dict().items()}
    with pytest.raises(RuntimeError) as caught:
        bare.load_state_dict(prefixed)
    hint = explain(caught.value)
    assert hint is not None and hint.startswith(
        "the checkpoint's keys start with 'module.' (saved from the DDP wrapper)"
    ), hint
    assert "ddpkit.model_state_dict(model)" in hint and "ddpkit.load_model_state" in hint
    wrapper = nn.Module()
    wrapper.module = nn.Linear(2, 2)
    with pytest.raises(RuntimeError) as caught:
        wrapper.load_state_dict(bare.state_dict())
    assert explain(caught.value).startswith("the model's keys start with 'module.' (a DDP")
    with pytest.raises(RuntimeError) as caught:
        bare.load_state_dict({"other.weight": torch.zeros(2, 2)})
    assert explain(caught.value) is None  # keys that differ otherwise: not this


@pytest.mark.parametrize(
    "message, expected",
    [
        (
            "[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 10000ms for recv "
            "operation to complete",
            "waited 10000 ms, the process group's timeout",
        ),
        (
            "Expected to mark a variable ready only once. This error is caused by ...",
            "use_reentrant=False, or wrap with static_graph=True",
        ),
        (
            "'DistributedDataParallel' object has no attribute 'encode'",
            "Use ddpkit.unwrap_model(model).encode, which works at every world size",
        ),
        ("'ResNet' object has no attribute 'module'", "(no DDP wrapper, so no .module)"),
        (
            "Expected more than 1 value per channel when training, got input size [1, 4]",
            "drop_last=True",
        ),
        (
            "Expected to have finished reduction in the prior iteration before starting a new one",
            "if parameters were frozen or replaced after wrapping, wrap the model again",
        ),
        (
            "Expected to have finished reduction in the prior iteration before starting a new one",
            "segment whose inputs do not require grad gives its parameters no gradient: pass "
            "use_reentrant=False",
        ),
    ],
)
def test_classic_ddp_messages_are_matched(message, expected):
    assert expected in explain(RuntimeError(message))


def test_the_hint_note_is_added_once():
    exc = AttributeError("'DistributedDataParallel' object has no attribute 'x'")
    add_hint_note(exc)
    add_hint_note(exc)
    assert exc.__notes__ == ["ddpkit hint: " + explain(exc)]
    plain = ValueError("something else")
    add_hint_note(plain)
    assert not hasattr(plain, "__notes__")
