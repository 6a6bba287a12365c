"""Exact resume: a run stopped at step k and resumed ends bitwise equal to an uninterrupted run.

MNIST-shaped (1x28x28 inputs, 10 classes, the main job's CNN), 2 ranks, Adam with a one-cycle
schedule (optimizer and scheduler state matter) and input noise drawn from the RNG (RNG state
matters). k at an epoch boundary and k in the middle of an epoch.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.app.mnist.model import MnistCNN
from ddpkit.testing import run_distributed

PER_RANK_BATCH = 4
NUM_SAMPLES = 48  # 6 steps per epoch on 2 ranks
TOTAL_STEPS = 15


def _data() -> TensorDataset:
    gen = torch.Generator().manual_seed(3)
    return TensorDataset(
        torch.randn(NUM_SAMPLES, 1, 28, 28, generator=gen),
        torch.randint(0, 10, (NUM_SAMPLES,), generator=gen),
    )


def _run(rt, directory, stop_after: int | None, resume: bool, seen: list[int] | None = None):
    torch.manual_seed(0 if not resume else 99)  # a resumed run must not depend on its own seed
    model = ddpkit.wrap_model(MnistCNN(), rt)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, 3e-3, total_steps=TOTAL_STEPS)
    data = _data()
    loader = ddpkit.build_train_loader(data, rt, batch_size=PER_RANK_BATCH, seed=1)
    state = {"model": model, "optimizer": optimizer, "scheduler": schedule, "loader": loader}
    ckpt = ddpkit.CheckpointManager(directory, rt, state=state, keep_last=2)
    step = ckpt.resume() if resume else 0
    while step < TOTAL_STEPS:
        for x, y in loader:
            if seen is not None:
                seen.extend(int((data.tensors[0] == s).all(dim=(1, 2, 3)).nonzero()) for s in x)
            x = x + 0.01 * torch.randn_like(x)  # draws from the RNG every step
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            schedule.step()
            step += 1
            if step == stop_after:
                ckpt.save(step)
                return None
            if step == TOTAL_STEPS:
                break
    return {k: v.clone() for k, v in ddpkit.model_state_dict(model).items()}


def _check_resume(rt, tmpdir: str, stop_after: int):
    reference = _run(rt, f"{tmpdir}/ref", None, resume=False)
    _run(rt, f"{tmpdir}/k", stop_after, resume=False)
    seen_after: list[int] = []
    resumed = _run(rt, f"{tmpdir}/k", None, resume=True, seen=seen_after)
    equal = all(torch.equal(reference[k], resumed[k]) for k in reference)
    return equal, seen_after


@pytest.mark.parametrize("stop_after", [6, 9])  # epoch boundary, middle of epoch 2
def test_resume_is_bitwise_exact(tmp_path, stop_after):
    results = run_distributed(_check_resume, 2, args=(str(tmp_path), stop_after), timeout_s=120)
    for equal, _ in results:
        assert equal
    if stop_after == 9:  # 3 of epoch 1's 6 steps remained: each remaining sample seen once
        first_epoch_rest = [s for _, seen in results for s in seen[: 3 * PER_RANK_BATCH]]
        assert len(first_epoch_rest) == len(set(first_epoch_rest)) == 3 * 2 * PER_RANK_BATCH
