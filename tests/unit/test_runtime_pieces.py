"""One-process checks of the runtime pieces: env detection, sharding, wrapping, logging."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.env import ProcessInfo, detect_process_info, slurm_rendezvous_defaults
from ddpkit.errors import ConfigError, DistributedError
from ddpkit.runtime.process_group import Runtime


def _runtime(rank: int = 0, world_size: int = 1) -> Runtime:
    return Runtime(
        ProcessInfo(rank=rank, world_size=world_size, local_world_size=world_size, local_rank=rank),
        backend=None,
        device=torch.device("cpu"),
    )


@pytest.mark.parametrize(
    "environ,expected",
    [
        ({}, ProcessInfo()),
        (
            {
                "RANK": "3",
                "WORLD_SIZE": "4",
                "LOCAL_RANK": "1",
                "LOCAL_WORLD_SIZE": "2",
                "GROUP_RANK": "1",
            },
            ProcessInfo(
                rank=3,
                local_rank=1,
                world_size=4,
                local_world_size=2,
                node_rank=1,
                source="torchrun",
            ),
        ),
        (
            {
                "SLURM_PROCID": "5",
                "SLURM_NTASKS": "6",
                "SLURM_LOCALID": "2",
                "SLURM_NODEID": "1",
                "SLURM_STEP_TASKS_PER_NODE": "3(x2)",
            },
            ProcessInfo(
                rank=5, local_rank=2, world_size=6, local_world_size=3, node_rank=1, source="slurm"
            ),
        ),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, ProcessInfo()),  # python inside salloc
        (  # torchrun inside a Slurm allocation: torchrun's variables win
            {
                "RANK": "1",
                "WORLD_SIZE": "2",
                "LOCAL_RANK": "1",
                "SLURM_PROCID": "0",
                "SLURM_NTASKS": "4",
            },
            ProcessInfo(
                rank=1,
                local_rank=1,
                world_size=2,
                local_world_size=2,
                node_rank=0,
                source="torchrun",
            ),
        ),
    ],
)
def test_detect_process_info(environ, expected):
    assert detect_process_info(environ) == expected


_SLURM_STEP = {  # what srun gave each task of `srun -n 2` on one node (slurm-wlm 22.05)
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "0",
    "SLURM_NTASKS": "2",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_STEP_TASKS_PER_NODE": "2",
    "SLURM_STEP_RESV_PORTS": "20019-20021",
}


@pytest.mark.parametrize(
    "changes,expected",
    [
        ({}, {"MASTER_PORT": "20019", "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}),
        (
            {"SLURM_STEP_RESV_PORTS": "12000"},
            {"MASTER_PORT": "12000", "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"},
        ),
        # no reserved ports (slurm.conf without MpiParams=ports): the port is not guessed
        ({"SLURM_STEP_RESV_PORTS": None}, {"MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}),
        # exported by the job: kept, and gloo's interface is the job's business then
        ({"MASTER_ADDR": "127.0.0.2", "MASTER_PORT": "2950"}, {}),
        ({"GLOO_SOCKET_IFNAME": "eth0"}, {"MASTER_PORT": "20019", "MASTER_ADDR": "127.0.0.1"}),
        # two nodes: rank 0's address is not guessed, the reserved port is the same everywhere
        (
            {
                "SLURM_STEP_NUM_NODES": "2",
                "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
                "SLURM_NODEID": "1",
                "SLURM_LOCALID": "0",
            },
            {"MASTER_PORT": "20019"},
        ),
    ],
)
def test_slurm_rendezvous_defaults(changes, expected):
    environ = {**_SLURM_STEP, **changes}
    environ = {name: value for name, value in environ.items() if value is not None}
    info = detect_process_info(environ)
    assert info.source == "slurm"
    assert slurm_rendezvous_defaults(info, environ) == expected


def test_slurm_rendezvous_defaults_only_under_an_srun_step():
    torchrun = {**_SLURM_STEP, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    assert slurm_rendezvous_defaults(detect_process_info(torchrun), torchrun) == {}
    one_task = {
        **_SLURM_STEP,
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_STEP_NUM_TASKS": "1",
    }
    assert slurm_rendezvous_defaults(detect_process_info(one_task), one_task) == {}


def test_detect_process_info_rejects_contradictions():
    with pytest.raises(ConfigError, match=r"rank=2 must be in \[0, world_size=2\)"):
        detect_process_info({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="WORLD_SIZE='two'. It must be an integer"):
        detect_process_info({"RANK": "0", "WORLD_SIZE": "two"})


@pytest.mark.slow  # a process importing torch: out of the inner loop
def test_world_size_without_a_launcher_is_refused_not_run_as_one_process(tmp_path):
    assert detect_process_info({"WORLD_SIZE": "1"}) == ProcessInfo()
    script = tmp_path / "train.py"
    script.write_text("import ddpkit\nwith ddpkit.init_runtime('gloo') as rt:\n    print(rt)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "SLURM_PROCID")}
    done = subprocess.run(
        [sys.executable, str(script)],
        env={**env, "WORLD_SIZE": "4"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and done.stdout == "", done
    assert (
        "ConfigError: WORLD_SIZE=4 is set but RANK is not, so no launcher started this process "
        "and it would train alone, as rank 0 of 1. Start the 4 ranks with a launcher (`ddpkit "
        "run -n 4 script.py`, `ddpkit train --nproc 4`, or `torchrun --nproc-per-node 4 "
        "script.py`), or unset WORLD_SIZE."
    ) in done.stderr


def test_sampler_shards_are_disjoint_complete_and_reshuffled_each_epoch():
    data = TensorDataset(torch.arange(16))
    loaders = [
        ddpkit.build_train_loader(data, _runtime(r, 2), batch_size=3, seed=5) for r in (0, 1)
    ]
    epochs = []
    for _ in range(3):
        shards = [[int(i) for (batch,) in loader for i in batch] for loader in loaders]
        assert set(shards[0]).isdisjoint(shards[1])
        assert sorted(shards[0] + shards[1]) == list(range(16))
        epochs.append(shards[0] + shards[1])
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2] and epochs[0] != epochs[2]
    assert [loader.epoch for loader in loaders] == [3, 3]


def test_eval_sampler_gives_each_sample_to_one_rank():
    data = TensorDataset(torch.arange(7))
    shards = [
        [int(i) for (b,) in ddpkit.build_eval_loader(data, _runtime(r, 3), batch_size=2) for i in b]
        for r in range(3)
    ]
    assert shards == [[0, 1, 2], [3, 4], [5, 6]]  # contiguous: rank-major is dataset order


def test_bad_batch_size_is_refused():
    with pytest.raises(ConfigError, match="batch_size='8'"):
        ddpkit.build_train_loader(TensorDataset(torch.arange(4)), _runtime(), batch_size="8")


def test_wrap_and_unwrap():
    runtime = _runtime()
    model = ddpkit.wrap_model(nn.Linear(2, 2), runtime)  # auto -> single at world size 1
    assert isinstance(model, nn.Linear)
    with pytest.raises(
        DistributedError, match="strategy='ddp' with world_size=1. It needs 2 or more"
    ):
        ddpkit.wrap_model(nn.Linear(2, 2), runtime, strategy="ddp")
    with pytest.raises(ConfigError, match="already wrapped in DataParallel"):
        ddpkit.wrap_model(nn.DataParallel(nn.Linear(2, 2)), runtime)
    with pytest.raises(ConfigError, match="unknown strategy"):
        ddpkit.wrap_model(nn.Linear(2, 2), runtime, strategy="fsdp3")
    wrapped = nn.DataParallel(nn.Linear(2, 2))
    assert ddpkit.unwrap_model(wrapped) is wrapped.module
    assert list(ddpkit.model_state_dict(wrapped)) == ["weight", "bias"]


def test_single_process_runtime_needs_no_process_group():
    with ddpkit.init_runtime() as rt:
        assert (rt.rank, rt.world_size, rt.backend, rt.process_group) == (0, 1, None, None)
        assert ddpkit.all_reduce_sum([2.0, 3.0], rt).tolist() == [2.0, 3.0]
    with pytest.raises(ConfigError, match="unknown backend"):
        ddpkit.init_runtime("mpi")
    with pytest.raises(ConfigError, match="init_timeout_s=0"):
        ddpkit.init_runtime(init_timeout_s=0)


def test_nccl_without_gpus_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="backend=nccl needs one CUDA device per local rank"):
        ddpkit.resolve_backend("nccl", ProcessInfo())


@pytest.mark.parametrize(
    "rank,shown", [(0, ["info", "[rank 0/2] WARNING: warn"]), (1, ["[rank 1/2] WARNING: warn"])]
)
def test_logging_info_on_rank_zero_warnings_everywhere(capsys, rank, shown):
    ddpkit.configure_logging(
        ProcessInfo(rank=rank, world_size=2, local_world_size=2, local_rank=rank)
    )
    ddpkit.configure_logging(
        ProcessInfo(rank=rank, world_size=2, local_world_size=2, local_rank=rank)
    )  # twice: no duplicate lines
    log = ddpkit.get_logger("t")
    log.info("info")
    log.warning("warn")
    captured = capsys.readouterr()
    assert captured.out.splitlines() + captured.err.splitlines() == shown
    assert logging.getLogger().handlers == [] or all(
        not getattr(h, "_ddpkit_handler", False) for h in logging.getLogger().handlers
    )


def _order(loader, passes: int) -> list[list[int]]:
    return [[int(i) for (b,) in loader for i in b] for _ in range(passes)]


def test_loader_state_resumes_exactly_including_capped_passes():
    data = TensorDataset(torch.arange(23))
    full = ddpkit.build_train_loader(data, _runtime(), batch_size=4, seed=2, max_batches=4)
    assert len(full) == 4
    reference = _order(full, 3)
    assert [len(p) for p in reference] == [16, 16, 16]  # 4 batches of 4 per pass
    for cut in range(1, 12):  # stop after `cut` batches, save, resume in a fresh loader
        first = ddpkit.build_train_loader(data, _runtime(), batch_size=4, seed=2, max_batches=4)
        seen, state = [], None
        for _ in range(3):
            for (batch,) in first:
                seen += [int(i) for i in batch]
                if len(seen) == 4 * cut:
                    state = first.state_dict()
                    break
            if state is not None:
                break
        resumed = ddpkit.build_train_loader(data, _runtime(), batch_size=4, seed=2, max_batches=4)
        resumed.load_state_dict(state)
        assert resumed.state_dict() == state  # before iterating: the loaded position
        while resumed.epoch < 3:
            seen += [int(i) for (b,) in resumed for i in b]
        assert seen == [i for p in reference for i in p], f"cut after {cut} batches"


@pytest.mark.slow
def test_a_listener_that_is_no_store_is_named_within_the_timeout_not_waited_on_forever():
    import socket
    import threading
    import time

    from ddpkit.runtime.rendezvous import STORE_GRACE_S, connect_store

    listener = socket.create_server(("127.0.0.1", 0))  # another program on MASTER_PORT
    port = listener.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True).start()
    start = time.monotonic()
    try:
        with pytest.raises(DistributedError) as refused:
            connect_store("127.0.0.1", port, 2, timeout_s=2)
    finally:
        listener.close()
    assert time.monotonic() - start < 2 + STORE_GRACE_S + 5  # torch's own client: > 120 s here
    assert str(refused.value).startswith(
        f"no rendezvous store answered at 127.0.0.1:{port} (MASTER_ADDR:MASTER_PORT) within 2 s, "
        f"and torch's client was still waiting: most likely another program holds port {port}"
    )
