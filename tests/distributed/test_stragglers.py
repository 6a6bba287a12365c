"""Straggler detection on real gloo ranks: the slow rank is named, with the slow phase.

One rank is really slowed (its dataset sleeps in ``__getitem__``, its model sleeps in forward
or in backward) and every other rank runs at full speed; DDP then makes every rank's step as
slow as the straggler's, so the straggler must be told apart by its own work, not by its step
time. A slowdown in backward is the hard case: the fast ranks' backward phase takes as long as
the straggler's (they wait in it for its gradients), so a plain phase timer shows nothing.
"""

from __future__ import annotations

import contextlib
import logging
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

import ddpkit
from ddpkit.monitoring.stragglers import RankWindow, StragglerDetector, judge
from ddpkit.runtime.process_group import ProcessInfo, Runtime
from ddpkit.testing import run_distributed
from tests.distributed.sleeps import SleepInBackward

BATCH = 4
WINDOW = 10  # steps per exchange in these tests (default 20): named after 30 steps


class _Samples(Dataset):
    """Random features; ``sleep_s`` per sample on ``slow_rank`` for its first ``slow_items``."""

    def __init__(self, n: int, sleep_s: float = 0.0, slow_rank: int = -1, slow_items: int = 10**9):
        gen = torch.Generator().manual_seed(3)
        self.x, self.y = torch.randn(n, 16, generator=gen), torch.randint(0, 4, (n,), generator=gen)
        self.sleep_s, self.slow_rank, self.slow_items, self.served = (
            sleep_s,
            slow_rank,
            slow_items,
            0,
        )

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int):
        self.served += 1
        if self.sleep_s and dist.get_rank() == self.slow_rank and self.served <= self.slow_items:
            time.sleep(self.sleep_s)
        return self.x[index], self.y[index]


class _Net(nn.Module):
    def __init__(self, forward_s: float = 0.0, backward_s: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.forward_s:
            time.sleep(self.forward_s)
        hidden = self.body[1](self.body[0](x))
        if self.backward_s:  # between the layers: the first layer's gradients come after it
            hidden = SleepInBackward.apply(hidden, self.backward_s)
        return self.body[2](hidden)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))


def _train(runtime: Runtime, case: str, num_steps: int) -> dict:
    """``case``: which rank is slow where (rank 1 unless said)."""
    slow = runtime.rank == 1
    net = _Net(
        forward_s=0.02 if case == "forward" and slow else 0.0,
        backward_s=0.02 if case == "backward" and slow else 0.0,
    )
    sleep_s = 0.005 if case in ("data", "data_then_fast") else 0.0
    slow_items = 40 * BATCH if case == "data_then_fast" else 10**9
    dataset = _Samples(num_steps * BATCH * runtime.world_size, sleep_s, 1, slow_items)
    model = ddpkit.wrap_model(net, runtime)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = ddpkit.build_train_loader(dataset, runtime, batch_size=BATCH, seed=1)
    detector = StragglerDetector(runtime, window=WINDOW)
    windows: list[list[RankWindow]] = []
    detector.listeners.append(windows.append)
    timer = ddpkit.StepTimer(runtime)
    lines = _Lines()
    logging.getLogger("ddpkit").addHandler(lines)
    logging.getLogger("ddpkit").setLevel(logging.INFO)
    step = ddpkit.TrainStep(model, optimizer, runtime=runtime, timer=timer, stragglers=detector)
    for _ in ddpkit.train_epoch(step, loader):
        pass
    logging.getLogger("ddpkit").removeHandler(lines)
    return {
        "summary": detector.summary(),
        "windows": windows,
        "warnings": [text for level, text in lines.lines if level == "WARNING"],
        "infos": [text for level, text in lines.lines if "straggler" in text and level == "INFO"],
        "backward_s": timer.seconds["backward_comm"],
    }


def _named(summary: dict) -> list[tuple[int, str]]:
    return [(named["rank"], named["phase"]) for named in summary["named"]]


def _cases(runtime: Runtime) -> dict:
    return {case: _train(runtime, case, 60) for case in ("data", "forward", "backward")}


@pytest.mark.slow
def test_the_slow_rank_is_named_with_its_slow_phase_once_on_rank_zero():
    results = run_distributed(_cases, 2, timeout_s=180)
    for case, phase in (("data", "data"), ("forward", "compute"), ("backward", "compute")):
        summaries = [result[case]["summary"] for result in results]
        assert summaries[0] == summaries[1], case  # every rank reached the same verdict
        assert _named(summaries[0]) == [(1, phase)], (case, summaries[0])
        named = summaries[0]["named"][0]
        assert named["named_step"] == 4 * WINDOW  # warm-up window, then 3 slow windows
        assert named["cleared_step"] is None and named["host"]
        # 5 ms per sample x 4 or 20 ms per micro-step against ~1 ms of own work
        assert named["rank_s"] >= 0.018 and named["factor"] >= 3, named
        assert named["others_s"] < named["rank_s"] / 3
        warnings = results[0][case]["warnings"]
        assert len(warnings) == 1, warnings  # one line, on rank 0 only
        assert results[1][case]["warnings"] == []
        line = warnings[0]
        assert line.startswith("straggler: rank 1 (host ") and "Fix:" in line, line
        assert ("data loading" if phase == "data" else "compute (forward") in line, line
        # the fast rank waits for the straggler's gradients: its comm_wait is the large one
        fast, slow = summaries[0]["ranks"]
        assert fast["comm_wait_s"] > slow["comm_wait_s"] + 0.01, (case, fast, slow)
    # a slow backward is invisible to the phase timer (the fast rank waits inside backward)
    backward = [result["backward"]["backward_s"] for result in results]
    assert backward[0] > 0.7 * backward[1], backward


def _balanced(runtime: Runtime) -> dict:
    return _train(runtime, "none", 90)


def test_a_balanced_run_names_no_one_and_every_rank_sees_every_rank():
    results = run_distributed(_balanced, 3, timeout_s=120)
    summary = results[0]["summary"]
    assert all(result["summary"] == summary for result in results)
    assert summary["named"] == [] and all(r["warnings"] == [] for r in results)
    assert summary["windows"] == 9 and summary["window"] == WINDOW
    assert [rank["rank"] for rank in summary["ranks"]] == [0, 1, 2]
    windows = results[0]["windows"]
    assert len(windows) == 9 and [w[0].step for w in windows] == list(range(10, 91, 10))
    for window in windows:
        assert [rank.rank for rank in window] == [0, 1, 2]
        assert all(rank.step_s > 0 and rank.samples_per_s > 0 for rank in window)
        assert abs(window[0].last_step_time - time.time()) < 120  # Unix time, seconds


def _recovers(runtime: Runtime) -> dict:
    return _train(runtime, "data_then_fast", 100)


def test_a_straggler_that_recovers_is_cleared_with_one_info_line():
    results = run_distributed(_recovers, 2, timeout_s=120)
    summary = results[0]["summary"]
    assert _named(summary) == [(1, "data")], summary
    named = summary["named"][0]
    # slow for its first 40 steps (windows 1-4; window 1 is warm-up), then 3 calm windows
    assert named["named_step"] == 40 and named["last_step"] == 40
    assert named["cleared_step"] == 70, named
    assert len(results[0]["warnings"]) == 1 and len(results[0]["infos"]) == 1
    assert "no longer slow in data loading at step 70" in results[0]["infos"][0]


def _uneven_join(runtime: Runtime) -> dict:
    dataset = _Samples(24 if runtime.rank == 0 else 40)
    model = ddpkit.wrap_model(_Net(), runtime)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    detector = StragglerDetector(runtime, window=3)
    step = ddpkit.TrainStep(
        model, optimizer, runtime=runtime, stragglers=detector, same_batch_sizes=True
    )
    batches = list(torch.utils.data.DataLoader(dataset, batch_size=BATCH))
    results = list(ddpkit.train_epoch(step, batches, join=True))
    after = list(ddpkit.train_epoch(step, batches[:6]))  # exchanges again once out of Join
    windows_after = detector.num_windows
    with ddpkit.join_uneven_inputs(model, runtime):  # the own-loop form of the same
        bare = [step(window) for window in step.windows(batches)]
    return {
        "steps": len(results),
        "windows": windows_after,
        "after": len(after),
        "bare": len(bare),
        "windows_bare": detector.num_windows,
    }


def test_join_pauses_the_exchange_so_uneven_ranks_do_not_hang():
    results = run_distributed(_uneven_join, 2, timeout_s=60)
    assert [r["steps"] for r in results] == [6, 10]  # rank 0 ran out first, under Join
    assert [r["windows"] for r in results] == [2, 2]  # none inside Join; 6 steps after it
    assert [r["bare"] for r in results] == [6, 10]  # TrainStep inside join_uneven_inputs
    assert [r["windows_bare"] for r in results] == [2, 2]


def test_judge_needs_both_the_factor_and_the_share_of_the_step():
    def ranks(*data_ms: float, compute_ms: float = 10.0, step_ms: float = 40.0):
        return [
            RankWindow(i, "h", d / 1e3, compute_ms / 1e3, 0.0, step_ms / 1e3, 1.0, 0.0, 5)
            for i, d in enumerate(data_ms)
        ]

    verdicts = judge(ranks(1.0, 1.0, 9.0, 1.0), factor=1.25, min_share=0.1)
    assert [(v.rank, v.phase) for v in verdicts] == [(2, "data")]
    assert verdicts[0].factor == pytest.approx(9.0) and verdicts[0].others_s == pytest.approx(1e-3)
    assert judge(ranks(1.0, 3.0), factor=1.25, min_share=0.1) == []  # 3x, but 2 ms of 40
    assert judge(ranks(20.0, 23.0), factor=1.25, min_share=0.1) == []  # 3 ms more, but 1.15x
    assert judge(ranks(20.0, 26.0), factor=1.25, min_share=0.1)[0].rank == 1
    assert judge(ranks(5.0), factor=1.25, min_share=0.1) == []  # one rank: nothing to compare


def test_bad_detector_settings_are_one_line_errors_and_one_process_has_none():
    single = Runtime(ProcessInfo())
    for kwargs in ({"window": 2}, {"factor": 1.0}, {"min_share": 1.0}, {"patience": 0}):
        with pytest.raises(ValueError, match=f"invalid StragglerDetector {next(iter(kwargs))}="):
            StragglerDetector(single, **kwargs)
    model = nn.Linear(2, 2)
    step = ddpkit.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), runtime=single)
    assert step.stragglers is None  # nothing to compare at world size 1


def _own_loop(runtime: Runtime, case: str, folder: str) -> dict:
    """The README's own loop: wrap_model, a plain loop, maybe_save once per step."""
    slow = runtime.rank == 1
    model = ddpkit.wrap_model(_Net(forward_s=0.02 if case == "forward" and slow else 0.0), runtime)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sleep_s = 0.005 if case.startswith("data") else 0.0
    num = 70 * BATCH * runtime.world_size * (4 if case == "data_accumulated" else 1)
    loader = ddpkit.build_train_loader(_Samples(num, sleep_s, 1), runtime, batch_size=BATCH, seed=1)
    probe = runtime.step_probe
    probe.detector.window = WINDOW
    lines = _Lines()
    logging.getLogger("ddpkit").addHandler(lines)
    ckpt = ddpkit.CheckpointManager(f"{folder}/{case}", runtime, state={"model": model})
    step = 0
    micro = 4 if case == "data_accumulated" else 1  # gradient accumulation by hand
    for index, (x, y) in enumerate(loader):
        last = (index + 1) % micro == 0
        with contextlib.nullcontext() if last else model.no_sync():
            torch.nn.functional.cross_entropy(model(x), y).backward()
        if not last:
            continue
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        ckpt.maybe_save(step)  # every_steps unset: never saves, but ends the step
    logging.getLogger("ddpkit").removeHandler(lines)
    with_train_step = ddpkit.TrainStep(model, optimizer, runtime=runtime, stragglers=False)
    return {
        "summary": probe.detector.summary(),
        "warnings": [text for level, text in lines.lines if level == "WARNING"],
        "probe_after_train_step": runtime.step_probe,
        "hooks_after_train_step": len(probe._handles),
        "train_step_stragglers": with_train_step.stragglers,
    }


def _own_loop_cases(runtime: Runtime, folder: str) -> dict:
    cases = ("data", "forward", "none", "data_accumulated")
    return {case: _own_loop(runtime, case, folder) for case in cases}


@pytest.mark.slow
def test_an_own_loop_gets_its_straggler_named_through_maybe_save(tmp_path):
    results = run_distributed(_own_loop_cases, 2, args=(str(tmp_path),), timeout_s=180)
    for case, expected in (
        ("data", [(1, "data")]),
        ("forward", [(1, "compute")]),
        ("none", []),
        ("data_accumulated", [(1, "data")]),
    ):
        summaries = [result[case]["summary"] for result in results]
        assert summaries[0] == summaries[1], case
        assert _named(summaries[0]) == expected, (case, summaries[0])
        assert summaries[0]["windows"] == 7, case  # 70 steps, windows of 10
        assert len(results[0][case]["warnings"]) == len(expected)
        assert results[1][case]["warnings"] == []
        # a TrainStep takes over (here: stragglers off): the loop's probe and hooks are gone
        assert results[0][case]["probe_after_train_step"] is None
        assert results[0][case]["hooks_after_train_step"] == 0
        assert results[0][case]["train_step_stragglers"] is None
    fast, slow = results[0]["forward"]["summary"]["ranks"]
    assert slow["compute_s"] > fast["compute_s"] + 0.015  # the 20 ms forward, nothing else
