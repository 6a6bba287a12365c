"""State left out of the checkpoint (issue 23 §4): an LR scheduler or a GradScaler the job uses
but did not put in ``CheckpointManager(state=...)`` is named in one warning, once per manager.

One process (world size 1): the check is local to rank 0. With the scheduler and the scaler in
the state, a resumed run goes on at the uninterrupted run's LR and loss scale (real values).
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.env import ProcessInfo
from ddpkit.runtime.process_group import Runtime

SCHEDULER_LINE = (
    "checkpoint state has no LR scheduler: state['optimizer'] is driven by StepLR, which is "
    "not in CheckpointManager(state=...). A resume restarts the schedule from its first LR "
    '(0.1) instead of going on from the saved step. Add it: state["scheduler"] = scheduler.'
)


def _runtime(rank: int = 0, world_size: int = 1) -> Runtime:
    return Runtime(ProcessInfo(rank=rank, world_size=world_size))


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _sgd(lr: float = 0.1) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=lr)


def _sgd_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler=None) -> None:
    optimizer.zero_grad()
    loss = model(torch.ones(4, 3)).square().mean()
    if scaler is None:
        loss.backward()
        optimizer.step()
        return
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


@pytest.fixture(autouse=True)
def _no_stray_scalers():
    gc.collect()  # scalers and schedulers of earlier tests must not be live objects here
    yield
    gc.collect()


def test_a_scheduler_left_out_is_named_once_at_resume(tmp_path, caplog):
    model, opt = _sgd()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ckpt = ddpkit.CheckpointManager(tmp_path, _runtime(), state={"model": model, "optimizer": opt})
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        assert ckpt.resume() == 0
        for step in (1, 2, 3):
            _sgd_step(model, opt)
            sched.step()
            ckpt.save(step)
    assert _warnings(caplog) == [SCHEDULER_LINE]
    assert caplog.records[0].name == "ddpkit.checkpoint"


def test_a_scheduler_left_out_is_named_at_the_first_save_without_resume(tmp_path, caplog):
    model, opt = _sgd()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ckpt = ddpkit.CheckpointManager(
        tmp_path, _runtime(), state={"model": model, "optimizer": opt}, every_steps=2
    )
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        for step in (1, 2, 3, 4):
            _sgd_step(model, opt)
            sched.step()
            ckpt.maybe_save(step)
            assert len(_warnings(caplog)) == (0 if step < 2 else 1)  # the first save that writes
    assert _warnings(caplog) == [SCHEDULER_LINE]


def test_no_warning_with_the_scheduler_in_state_or_without_any(tmp_path, caplog):
    model, opt = _sgd()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    state = {"model": model, "optimizer": opt, "scheduler": sched}
    plain_model, plain_opt = _sgd()
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        ckpt = ddpkit.CheckpointManager(tmp_path / "a", _runtime(), state=state)
        ckpt.resume()
        ckpt.save(1)
        plain = {"model": plain_model, "optimizer": plain_opt}
        ddpkit.CheckpointManager(tmp_path / "b", _runtime(), state=plain).save(1)
    assert _warnings(caplog) == []


def test_reduce_lr_on_plateau_which_marks_nothing_is_found_too(tmp_path, caplog):
    model, opt = _sgd()
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=1)
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        state = {"model": model, "optimizer": opt}
        ddpkit.CheckpointManager(tmp_path / "a", _runtime(), state=state).save(1)
        assert _warnings(caplog) == [
            "checkpoint state has no LR scheduler: state['optimizer'] is driven by "
            "ReduceLROnPlateau, which is not in CheckpointManager(state=...). A resume restarts "
            "its best metric and patience count, so LR reductions come late. Add it: "
            'state["scheduler"] = scheduler.'
        ]
        caplog.clear()
        saved = {**state, "scheduler": plateau}
        ddpkit.CheckpointManager(tmp_path / "b", _runtime(), state=saved).save(1)
    assert _warnings(caplog) == []


class _Optimizers:
    """Two optimizers checkpointed as one entry (a GAN's generator and discriminator)."""

    def __init__(self, **optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    def state_dict(self) -> dict:
        return {n: o.state_dict() for n, o in self.optimizers.items()}

    def load_state_dict(self, state: dict) -> None:
        for name, opt in self.optimizers.items():
            opt.load_state_dict(state[name])


def test_an_optimizer_held_one_level_down_is_checked(tmp_path, caplog):
    model, gen = _sgd()
    disc = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(disc, max_lr=0.3, total_steps=10)
    state = {"model": model, "optimizers": _Optimizers(gen=gen, disc=disc)}
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        ddpkit.CheckpointManager(tmp_path / "a", _runtime(), state=state).resume()
        assert _warnings(caplog) == [
            "checkpoint state has no LR scheduler: state['optimizers'] is driven by OneCycleLR, "
            "which is not in CheckpointManager(state=...). A resume restarts the schedule from "
            "its first LR (0.012) instead of going on from the saved step. Add it: "
            'state["scheduler"] = scheduler.'
        ]
        caplog.clear()
        saved = {**state, "scheduler": sched}
        ddpkit.CheckpointManager(tmp_path / "b", _runtime(), state=saved).resume()
    assert _warnings(caplog) == []


def test_only_rank_zero_checks_and_the_objects_are_scanned_once_per_occasion(
    tmp_path, caplog, monkeypatch
):
    model, opt = _sgd()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)  # noqa: F841 - drives opt
    scans = []
    real = gc.get_objects
    monkeypatch.setattr(gc, "get_objects", lambda *a, **k: scans.append(1) or real(*a, **k))
    state = {"model": model, "optimizer": opt}
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        other_rank = _runtime(rank=1, world_size=2)
        ddpkit.CheckpointManager(tmp_path / "r1", other_rank, state=state).resume()
        assert scans == [] and _warnings(caplog) == []
        ckpt = ddpkit.CheckpointManager(tmp_path / "r0", _runtime(), state=state, every_steps=1)
        ckpt.resume()
        for step in (1, 2, 3):
            ckpt.maybe_save(step)
        ckpt.resume()
    assert len(scans) == 2  # its first resume and its first save, never again
    assert _warnings(caplog) == [SCHEDULER_LINE]  # each finding once


def _scheduled_run(directory, *, stop_at: int | None, resume: bool, in_state: bool) -> float:
    """SGD at lr 0.1 halved every 4 steps, 12 steps; returns the LR at the end."""
    model, opt = _sgd()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    state = {"model": model, "optimizer": opt, **({"scheduler": sched} if in_state else {})}
    ckpt = ddpkit.CheckpointManager(directory, _runtime(), state=state)
    step = ckpt.resume() if resume else 0
    while step < 12:
        _sgd_step(model, opt)
        sched.step()
        step += 1
        if step == stop_at:
            ckpt.save(step)
            return opt.param_groups[0]["lr"]
    return opt.param_groups[0]["lr"]


def test_a_resumed_run_with_the_scheduler_in_state_goes_on_at_the_right_lr(tmp_path, caplog):
    uninterrupted = _scheduled_run(tmp_path / "ref", stop_at=None, resume=False, in_state=True)
    assert uninterrupted == pytest.approx(0.1 * 0.5**3)
    assert _scheduled_run(tmp_path / "k", stop_at=6, resume=False, in_state=True) == 0.05
    resumed = _scheduled_run(tmp_path / "k", stop_at=None, resume=True, in_state=True)
    assert resumed == uninterrupted  # exactly
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        _scheduled_run(tmp_path / "lost", stop_at=6, resume=False, in_state=False)
        lost = _scheduled_run(tmp_path / "lost", stop_at=None, resume=True, in_state=False)
    assert lost == pytest.approx(0.025) and lost != uninterrupted  # what the warning is about
    assert _warnings(caplog).count(SCHEDULER_LINE) == 2  # one per manager


def test_a_scheduler_in_state_round_trips_exactly(tmp_path):
    model, opt = _sgd()
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.3, total_steps=20)
    for _ in range(7):
        _sgd_step(model, opt)
        sched.step()
    state = {"model": model, "optimizer": opt, "scheduler": sched}
    ddpkit.CheckpointManager(tmp_path, _runtime(), state=state).save(7)
    model2, opt2 = _sgd()
    sched2 = torch.optim.lr_scheduler.OneCycleLR(opt2, max_lr=0.3, total_steps=20)
    state2 = {"model": model2, "optimizer": opt2, "scheduler": sched2}
    assert ddpkit.CheckpointManager(tmp_path, _runtime(), state=state2).resume() == 7
    assert sched2.state_dict() == sched.state_dict()
    assert sched2.last_epoch == 7 and sched2.get_last_lr() == sched.get_last_lr()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def _scaled_run(directory, *, stop_at: int | None, resume: bool, in_state: bool):
    """SGD through a GradScaler whose scale doubles every 2 steps; 9 steps; returns it."""
    model, opt = _sgd()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    state = {"model": model, "optimizer": opt, **({"scaler": scaler} if in_state else {})}
    ckpt = ddpkit.CheckpointManager(directory, _runtime(), state=state)
    step = ckpt.resume() if resume else 0
    while step < 9:
        _sgd_step(model, opt, scaler)
        step += 1
        if step == stop_at:
            ckpt.save(step)
            break
    return scaler


def test_a_grad_scaler_left_out_is_named_at_the_first_save(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        scaler = _scaled_run(tmp_path, stop_at=5, resume=False, in_state=False)
    assert scaler.get_scale() == 4096.0
    assert _warnings(caplog) == [
        "checkpoint state has no GradScaler: state['optimizer'] is stepped through a GradScaler "
        "(loss scale now 4096), which is not in CheckpointManager(state=...). A resume restarts "
        "the loss scale at 1024 (its init_scale) and its growth count at 0. Add it: "
        'state["scaler"] = scaler (a MixedPrecision\'s: precision.scaler).'
    ]


def test_no_warning_for_a_scaler_in_state_disabled_or_never_used(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        _scaled_run(tmp_path / "in", stop_at=5, resume=False, in_state=True)
        model, opt = _sgd()
        unused = torch.amp.GradScaler("cpu")  # noqa: F841 - live, enabled, never scaled
        disabled = torch.amp.GradScaler("cpu", enabled=False)
        _sgd_step(model, opt, disabled)
        ddpkit.CheckpointManager(tmp_path / "x", _runtime(), state={"optimizer": opt}).save(1)
    assert _warnings(caplog) == []


def test_a_resumed_run_with_the_scaler_in_state_goes_on_at_the_same_scale(tmp_path):
    uninterrupted = _scaled_run(tmp_path / "ref", stop_at=None, resume=False, in_state=True)
    assert uninterrupted.get_scale() == 1024.0 * 2**4  # doubled after steps 2, 4, 6, 8
    saved = _scaled_run(tmp_path / "k", stop_at=5, resume=False, in_state=True)
    assert saved.state_dict()["_growth_tracker"] == 1  # mid-interval: the count matters too
    resumed = _scaled_run(tmp_path / "k", stop_at=None, resume=True, in_state=True)
    assert resumed.state_dict() == uninterrupted.state_dict()
    assert resumed.get_scale() == 16384.0


def test_a_deleted_scheduler_is_not_named_though_torch_marked_the_optimizer(tmp_path, caplog):
    model, optimizer = _sgd()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    del scheduler
    gc.collect()
    assert getattr(optimizer.step, "_wrapped_by_lr_sched", False)  # the mark outlives it
    state = {"model": model, "optimizer": optimizer}
    ddpkit.CheckpointManager(tmp_path, _runtime(), state=state).save(1)
    assert _warnings(caplog) == []


def test_a_second_managers_scaler_is_not_taken_for_this_ones(tmp_path, caplog):
    (g, opt_g), (d, opt_d) = _sgd(), _sgd()
    scaler_g, scaler_d = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    _sgd_step(g, opt_g, scaler_g)
    _sgd_step(d, opt_d, scaler_d)  # D's scaler, saved by D's manager
    state = {"model": g, "optimizer": opt_g, "scaler": scaler_g}
    ddpkit.CheckpointManager(tmp_path / "g", _runtime(), state=state).save(1)
    assert _warnings(caplog) == []
