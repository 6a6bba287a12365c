"""A stop signal to one rank stops every rank after the same step, with a checkpoint at it; the
run resumed from it ends bitwise equal to an uninterrupted run (2 and 3 ranks, gloo)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.checkpoint.io import load_checkpoint
from ddpkit.runtime.stop import MAX_CHECK_CALLS
from ddpkit.testing import run_distributed

TOTAL_STEPS = 40
SIGNAL_AT = 9  # the step after which the signalled rank gets its signal


def _data() -> TensorDataset:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(192, 8, generator=gen)
    return TensorDataset(x, x.argmax(dim=1))


def _train(rt, directory: str, signalled_rank: int | None, sig: int) -> dict:
    """The README's loop; ``signalled_rank`` sends itself ``sig`` after step SIGNAL_AT."""
    torch.manual_seed(0)
    # One parameter tensor: at 3+ ranks a resumed DDP run is bitwise exact only when its first
    # step's gradient bucket has the layout of the rebuilt buckets the uninterrupted run used
    # (DDP rebuilds them after its first step; the ring all-reduce's summation order follows
    # the layout). With one tensor both layouts are the same. See docs/checkpoints.md.
    model = ddpkit.wrap_model(torch.nn.Linear(8, 8, bias=False), rt)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = ddpkit.build_train_loader(_data(), rt, batch_size=8, seed=0)
    state = {"model": model, "optimizer": opt, "loader": loader}
    ckpt = ddpkit.CheckpointManager(directory, rt, state=state, every_steps=4)
    step = ckpt.resume()
    first = step
    try:
        while step < TOTAL_STEPS:
            for x, y in loader:
                opt.zero_grad()
                F.cross_entropy(model(x + 0.01 * torch.randn_like(x)), y).backward()
                opt.step()
                step += 1
                if step == SIGNAL_AT and rt.rank == signalled_rank:
                    os.kill(os.getpid(), sig)
                ckpt.maybe_save(step)
                if step == TOTAL_STEPS:
                    break
    except ddpkit.TrainingStopped as stopped:
        load_checkpoint(stopped.checkpoint)  # complete: its checksum verifies (else DataError)
        return {
            "leftovers": [p.name for p in Path(directory).glob(".tmp-*")],
            "stopped_at": stopped.step,
            "saved": stopped.saved,
            "code": stopped.code,
            "signal": int(stopped.signal),
            "here": stopped.here,
            "rank": rt.rank,
            "first": first,
            "checkpoint": str(stopped.checkpoint),
        }
    params = {k: v.clone() for k, v in ddpkit.model_state_dict(model).items()}
    return {"params": params, "first": first}


def _stop_and_resume(rt, tmpdir: str, signalled_rank: int, sig: int) -> list:
    reference = _train(rt, f"{tmpdir}/ref", None, sig)
    stopped = _train(rt, f"{tmpdir}/stop", signalled_rank, sig)
    rt.stop.clear()  # here the same process trains on; a real job has ended and restarts
    resumed = _train(rt, f"{tmpdir}/stop", None, sig)
    equal = all(
        torch.equal(reference["params"][k], resumed["params"][k]) for k in reference["params"]
    )
    return [stopped, resumed["first"], equal]


@pytest.mark.parametrize(
    ("world_size", "signalled_rank", "sig"),
    [(2, 1, signal.SIGTERM), (3, 2, signal.SIGUSR1), (3, 0, signal.SIGINT)],
)
@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_at_one_step(
    tmp_path, world_size, signalled_rank, sig
):
    results = run_distributed(
        _stop_and_resume, world_size, args=(str(tmp_path), signalled_rank, sig), timeout_s=150
    )
    stops = [stopped for stopped, _, _ in results]
    steps = {s["stopped_at"] for s in stops}
    assert len(steps) == 1, stops  # every rank after the same step
    (stop_step,) = steps
    assert SIGNAL_AT <= stop_step <= SIGNAL_AT + MAX_CHECK_CALLS, stops  # the next check
    assert all(s["signal"] == sig and s["code"] == 128 + sig for s in stops), stops
    # only the signalled rank received it; the others stopped on the agreement
    assert [s["here"] for s in stops] == [s["rank"] == signalled_rank for s in stops], stops
    if stop_step % 4:  # not a periodic checkpoint step: this stop wrote it
        assert all(s["saved"] for s in stops), stops
    folder = tmp_path / "stop" / f"step-{stop_step:08d}"  # verified by load_checkpoint
    assert all(s["checkpoint"] == str(folder) and not s["leftovers"] for s in stops), stops
    for _, resumed_first, equal in results:
        assert resumed_first == stop_step  # 0 lost steps: the resumed run starts where it stopped
        assert equal  # bitwise the uninterrupted run's parameters
