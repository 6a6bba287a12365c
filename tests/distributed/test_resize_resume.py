"""Resuming on another number of ranks: 2 -> 3, 3 -> 2 and 4 -> 2, each stopped mid-epoch.

A run on N ranks saves mid-epoch; a run on M ranks resumes it with ``CheckpointManager.resume``
and the per-rank batch and micro-steps that keep the global batch (``fit_global_batch``). Counted
through the dataset's own ``__getitem__``: every remaining sample of the interrupted epoch is
trained exactly once after the change, none trained before the stop is trained again, and every
later step trains on the same samples as the uninterrupted N-rank run. Compared: the optimizer,
scheduler and grad-scaler state right after the resume against what was saved, and the loss of
every step after the change against the uninterrupted N-rank run, which differ only by the order
of float reductions (a different split of the same samples over ranks and micro-steps).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import ddpkit
from ddpkit.testing import run_distributed

NUM_SAMPLES, GLOBAL_BATCH, EPOCHS = 48, 12, 2  # 4 optimizer steps per epoch at any world size
TOTAL_STEPS = EPOCHS * NUM_SAMPLES // GLOBAL_BATCH
# The largest |loss - uninterrupted loss| / |uninterrupted loss| over the steps after a resize,
# measured over the three cases below (pytest -s prints it; 2 cores, torch 2.13.0+cpu): 8.9e-8
# in float32 (under float32's epsilon, 1.2e-7), 2.5e-5 in 16-mixed (float16 products). The bounds
# leave 10x room for other CPUs' kernels; docs/checkpoints.md states them.
LOSS_RTOL = {"32": 1e-6, "16-mixed": 2.5e-4}


class _Recorded(Dataset):
    """48 samples of a 4-class task; remembers which indices this process fetched."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(7)
        self.x = torch.randn(NUM_SAMPLES, 8, generator=gen)
        self.y = self.x[:, :4].argmax(dim=1)
        self.seen: list[int] = []

    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, index: int):
        self.seen.append(int(index))
        return self.x[index], self.y[index]


def _snapshot(optimizer, schedule, scaler) -> dict:
    return copy.deepcopy(
        {
            "optimizer": optimizer.state_dict(),
            "scheduler": schedule.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else None,
        }
    )


def _train(rt, directory, batch_size, micro_steps, precision, stop_after=None, resume=False):
    """Train to TOTAL_STEPS (or save at ``stop_after`` and return); per step: this rank's loss
    sum, the global sample count and the indices this rank trained."""
    torch.manual_seed(0 if not resume else 99)  # a resumed run must not depend on its own seed
    data = _Recorded()
    model = ddpkit.wrap_model(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)), rt)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, 3e-2, total_steps=TOTAL_STEPS)
    precision = ddpkit.MixedPrecision(precision, rt, init_scale=256.0, growth_interval=2)
    loader = ddpkit.build_train_loader(data, rt, batch_size=batch_size, seed=3)
    state = {
        "model": model,
        "optimizer": optimizer,
        "scheduler": schedule,
        "scaler": precision.scaler,
        "loader": loader,
    }
    ckpt = ddpkit.CheckpointManager(directory, rt, state=state)
    step = ckpt.resume() if resume else 0
    out = {"resumed_at": step, "steps": []}
    if resume:
        out["after_resume"] = _snapshot(optimizer, schedule, precision.scaler)
    train_step = ddpkit.TrainStep(
        model,
        optimizer,
        runtime=rt,
        num_micro_steps=micro_steps,
        precision=precision,
        start_step=step,
    )
    while loader.epoch < EPOCHS:
        for result in ddpkit.train_epoch(train_step, loader):
            if not result.skipped:
                schedule.step()
            indices, data.seen = data.seen, []
            out["steps"].append(
                (result.step, sum(result.loss_sums), result.num_samples_global, indices)
            )
            if result.step == stop_after:
                ckpt.save(result.step)
                out["saved"] = _snapshot(optimizer, schedule, precision.scaler)
                return out
    out["final_scale"] = None if precision.scaler is None else precision.scaler.get_scale()
    return out


def _on_n_ranks(rt, tmpdir, case):
    old_ws, batch_size, _, stop, precision = case
    reference = _train(rt, f"{tmpdir}/ref", batch_size, 1, precision)
    stopped = _train(rt, f"{tmpdir}/ckpt", batch_size, 1, precision, stop_after=stop)
    return reference, stopped


def _on_m_ranks(rt, tmpdir, case):
    old_ws, batch_size, new_ws, _, precision = case
    fitted, micro_steps = ddpkit.fit_global_batch(GLOBAL_BATCH, new_ws, batch_size=batch_size)
    return _train(rt, f"{tmpdir}/ckpt", fitted, micro_steps, precision, resume=True)


def _global(runs) -> dict[int, tuple[float, int, list[int]]]:
    """step -> (global mean loss, global samples, every rank's indices) from every rank's run."""
    steps = {}
    for run in runs:
        for step, loss_sum, num_global, indices in run["steps"]:
            total, _, seen = steps.get(step, (0.0, num_global, []))
            steps[step] = (total + loss_sum, num_global, seen + indices)
    return {s: (total / n, n, seen) for s, (total, n, seen) in steps.items()}


def _same_state(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b, strict=True))
    return a == b


# (N, per-rank batch on N, M, stop after step); the global batch is 12 in each
CASES = {
    "2->3": (2, 6, 3, 2),  # on 3 ranks: 4 per rank, 1 micro-step
    "3->2": (3, 4, 2, 5),  # on 2 ranks: 3 per rank x 2 micro-steps; stop in epoch 2
    "4->2": (4, 3, 2, 2),  # on 2 ranks: 3 x 2
}


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["32", "16-mixed"])  # 16-mixed: the loss scale grows
@pytest.mark.parametrize("name", sorted(CASES))
def test_resume_on_another_world_size_sees_every_sample_once(tmp_path, name, precision):
    case = (*CASES[name], precision)
    old_ws, _, new_ws, stop, _ = case
    first = run_distributed(_on_n_ranks, old_ws, args=(str(tmp_path), case), timeout_s=180)
    resumed = run_distributed(_on_m_ranks, new_ws, args=(str(tmp_path), case), timeout_s=180)
    reference = _global([ref for ref, _ in first])
    before = _global([stopped for _, stopped in first])
    after = _global(resumed)
    assert all(run["resumed_at"] == stop for run in resumed)
    assert sorted(after) == list(range(stop + 1, TOTAL_STEPS + 1))
    # counted: the interrupted epoch's samples before the stop and after it, each exactly once
    per_epoch = NUM_SAMPLES // GLOBAL_BATCH
    epoch_start = (stop // per_epoch) * per_epoch
    done = [i for s in range(epoch_start + 1, stop + 1) for i in before[s][2]]
    rest = [i for s in range(stop + 1, epoch_start + per_epoch + 1) for i in after[s][2]]
    assert len(done) == len(set(done)) and len(rest) == len(set(rest))
    assert not set(done) & set(rest)  # nothing trained before the stop is trained again
    assert sorted(done + rest) == list(range(NUM_SAMPLES))  # and nothing is left out
    for s in after:  # every later step: the same samples as the uninterrupted run's
        assert after[s][1] == GLOBAL_BATCH and sorted(after[s][2]) == sorted(reference[s][2])
    # optimizer, scheduler and scaler: exactly what was saved, on every new rank
    saved = first[0][1]["saved"]
    assert all(_same_state(run["after_resume"], saved) for run in resumed)
    assert saved["scheduler"]["last_epoch"] == stop
    if precision == "16-mixed":
        assert saved["scaler"]["scale"] == 256.0 * 2 ** (stop // 2)  # carried, not reset
        assert resumed[0]["final_scale"] == first[0][0]["final_scale"] > 256.0
    # the losses: the uninterrupted run's, within float reduction order
    diff = {s: abs(after[s][0] - reference[s][0]) for s in after}
    rel = max(diff[s] / abs(reference[s][0]) for s in after)
    print(
        f"{name} {precision}: loss vs uninterrupted: max abs {max(diff.values()):.3g}, "
        f"max rel {rel:.3g}"
    )
    assert rel <= LOSS_RTOL[precision], f"{name}: largest relative loss difference {rel:.3g}"


def _zero_run(rt, directory: str, stop_after: int | None, resume: bool):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.manual_seed(0)
    model = ddpkit.wrap_model(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2)), rt)
    optimizer = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2
    )
    ckpt = ddpkit.CheckpointManager(directory, rt, state={"model": model, "optimizer": optimizer})
    first = ckpt.resume() + 1 if resume else 1
    restored = None
    if resume:  # the whole state, gathered from the new shards, against the saved one
        optimizer.consolidate_state_dict(to=0)
        restored = copy.deepcopy(optimizer.state_dict()) if rt.is_rank_zero else None
    for step in range(first, (stop_after or first) + 1):
        gen = torch.Generator().manual_seed(step)  # the same global batch on any world size
        x, y = torch.randn(12, 6, generator=gen), torch.randn(12, 2, generator=gen)
        shard = slice(rt.rank * 12 // rt.world_size, (rt.rank + 1) * 12 // rt.world_size)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x[shard]), y[shard]).backward()
        optimizer.step()
        if step == stop_after:
            ckpt.save(step)
            return None
    return restored  # and one more step on the new shards ran


@pytest.mark.slow
def test_zero_redundancy_optimizer_reshards_on_another_world_size(tmp_path):
    from ddpkit.checkpoint.export import read_sharded_entry

    run_distributed(_zero_run, 2, args=(str(tmp_path), 3, False), timeout_s=120)
    restored = run_distributed(_zero_run, 3, args=(str(tmp_path), None, True), timeout_s=120)
    # each rank's shard went through DCP; read here whole, in one process
    saved = read_sharded_entry(tmp_path / "step-00000003", "optimizer")
    assert _same_state(restored[0]["state"], saved["state"])  # every parameter's Adam moments
    assert len(saved["state"]) == 4  # two layers' weights and biases, now split over 3 ranks
