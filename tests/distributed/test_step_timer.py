"""StepTimer in TrainStep/train_epoch: each phase gets the time spent in it, on 2 gloo ranks.

A dataset that sleeps in ``__getitem__`` must show up as data wait, a model that sleeps in
forward as forward, one that sleeps in backward as backward_comm, also with K = 2 micro-steps
per optimizer step. The sleeps give lower bounds (never speed targets). The timer must not
change what is trained, and its epoch summary costs exactly one collective.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

import ddpkit
from ddpkit.monitoring.observe import PHASES, StepTimer
from ddpkit.runtime.process_group import Runtime
from ddpkit.testing import run_distributed
from tests.distributed.sleeps import SleepInBackward

SLEEP_S = 0.02  # per sample in the slow dataset (4 x 4 samples: 0.32 s)
# per micro-step in the slow model: 4 x 0.1 s, well above the peer waits a loaded machine adds
# to the other phases (backward_comm includes waiting for the other rank's all-reduce)
MODEL_SLEEP_S = 0.1
BATCH = 4
SAMPLES_PER_RANK = 16  # 4 batches per rank


class _Samples(Dataset):
    def __init__(self, sleep_s: float) -> None:
        gen = torch.Generator().manual_seed(3)
        self.x = torch.randn(SAMPLES_PER_RANK * 2, 6, generator=gen)
        self.y = torch.randint(0, 3, (SAMPLES_PER_RANK * 2,), generator=gen)
        self.sleep_s = sleep_s

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return self.x[index], self.y[index]


class _Net(nn.Module):
    def __init__(self, forward_sleep_s: float = 0.0, backward_sleep_s: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        self.forward_sleep_s, self.backward_sleep_s = forward_sleep_s, backward_sleep_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.forward_sleep_s:
            time.sleep(self.forward_sleep_s)
        if self.backward_sleep_s:
            x = SleepInBackward.apply(x.requires_grad_(), self.backward_sleep_s)
        return self.body(x)


def _epoch(runtime: Runtime, net: nn.Module, data_sleep_s: float, k: int, timed: bool) -> dict:
    model = ddpkit.wrap_model(net, runtime)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = ddpkit.build_train_loader(_Samples(data_sleep_s), runtime, batch_size=BATCH, seed=1)
    timer = StepTimer(runtime) if timed else None
    step = ddpkit.TrainStep(model, optimizer, runtime=runtime, num_micro_steps=k, timer=timer)
    for _ in ddpkit.train_epoch(step, loader):
        pass
    params = [p.detach().clone() for p in model.parameters()]
    if timer is None:
        return {"params": params}
    num_steps, num_samples = timer.num_steps, timer.num_samples
    local = dict(timer.seconds)
    calls = []
    real_all_reduce = dist.all_reduce
    dist.all_reduce = lambda *a, **kw: calls.append(1) or real_all_reduce(*a, **kw)
    try:
        summary = timer.epoch_summary(runtime)
    finally:
        dist.all_reduce = real_all_reduce
    return {
        "params": params,
        "summary": summary,
        "local": local,
        "num_steps": num_steps,
        "num_samples": num_samples,
        "num_collectives": len(calls),
        "own_peak_mb": ddpkit.peak_memory_mb(runtime.device),
    }


def _phase_cases(runtime: Runtime) -> dict:
    return {
        "slow_data": _epoch(runtime, _Net(), SLEEP_S, 1, True),
        "slow_forward": _epoch(runtime, _Net(forward_sleep_s=MODEL_SLEEP_S), 0.0, 1, True),
        "slow_backward_k2": _epoch(runtime, _Net(backward_sleep_s=MODEL_SLEEP_S), 0.0, 2, True),
        "slow_forward_k2": _epoch(runtime, _Net(forward_sleep_s=MODEL_SLEEP_S), 0.0, 2, True),
        "untimed_k2": _epoch(runtime, _Net(forward_sleep_s=MODEL_SLEEP_S), 0.0, 2, False),
    }


def test_each_phase_gets_its_time_also_with_accumulation():
    results = run_distributed(_phase_cases, 2, timeout_s=120)
    num_batches = SAMPLES_PER_RANK // BATCH
    for rank, cases in enumerate(results):
        data = cases["slow_data"]
        # every sample of the 4 batches slept in __getitem__ (num_workers=0): in data_wait
        assert data["local"]["data_wait"] >= SLEEP_S * BATCH * num_batches, (rank, data)
        assert all(data["local"][p] < data["local"]["data_wait"] for p in PHASES[1:]), data
        forward = cases["slow_forward"]
        assert forward["local"]["forward"] >= MODEL_SLEEP_S * num_batches, (rank, forward)
        assert all(
            forward["local"][p] < forward["local"]["forward"] for p in PHASES if p != "forward"
        ), forward
        # K = 2: 4 micro-steps make 2 optimizer steps; forward/backward cover all 4
        for name, phase in (("slow_forward_k2", "forward"), ("slow_backward_k2", "backward_comm")):
            case = cases[name]
            assert case["num_steps"] == num_batches // 2, case
            assert case["num_samples"] == SAMPLES_PER_RANK * 2, case  # global samples
            assert case["local"][phase] >= MODEL_SLEEP_S * num_batches, (rank, name, case)
            per_step = case["summary"][f"{phase}_s_per_step"]
            assert per_step >= MODEL_SLEEP_S * 2, (name, per_step)  # mean over ranks, per step
        # timing changes nothing that is computed
        timed, untimed = cases["slow_forward_k2"]["params"], cases["untimed_k2"]["params"]
        assert all(torch.equal(a, b) for a, b in zip(timed, untimed, strict=True))
    for name in ("slow_data", "slow_forward", "slow_forward_k2", "slow_backward_k2"):
        per_rank = [cases[name] for cases in results]
        summaries = [c["summary"] for c in per_rank]
        assert summaries[0] == summaries[1]  # the reduced values agree on every rank
        assert all(c["num_collectives"] == 1 for c in per_rank)  # ONE collective per epoch
        for phase in PHASES:  # the mean over ranks of each phase's epoch sum
            mean = sum(c["local"][phase] for c in per_rank) / 2
            assert abs(summaries[0][f"{phase}_s"] - mean) < 1e-9
            assert abs(summaries[0][f"{phase}_s_per_step"] - mean / per_rank[0]["num_steps"]) < 1e-9
        # peak memory: the largest rank's peak RSS, in MiB (ru_maxrss is KiB on Linux)
        peak = summaries[0]["peak_memory_mb"]
        assert 10 < peak <= max(c["own_peak_mb"] for c in per_rank)
        assert peak >= min(c["own_peak_mb"] for c in per_rank) - 1.0
