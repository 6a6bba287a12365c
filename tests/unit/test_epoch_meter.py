"""The epoch figures of ``ddpkit train`` across a resume (#16 §3), at world size 1.

The 2-rank path (a rank killed mid-epoch, the restart's record equal to an uninterrupted run's)
is tests/e2e/test_train_e2e.py::test_killed_rank_restarts_and_resumes_to_the_same_parameters.
"""

from __future__ import annotations

from ddpkit.app.mnist.epoch_meter import EpochMeter, coverage_note
from ddpkit.env import ProcessInfo
from ddpkit.runtime.process_group import Runtime
from ddpkit.training.step import StepResult

SINGLE = Runtime(ProcessInfo())


def _result(step: int) -> StepResult:
    return StepResult(
        step=step,
        loss_sums=(0.5 * step, 0.25),
        num_samples=8,
        num_samples_global=8,
        skipped=False,
    )


def _run(meter: EpochMeter, steps: range, *, sync_every: int) -> None:
    for step in steps:
        meter.add(_result(step))
        if step % sync_every == 0:
            meter.sync(SINGLE, step)


def test_a_resumed_epoch_goes_on_from_the_saved_sums():
    whole = EpochMeter()
    whole.start(1, 0)
    _run(whole, range(1, 13), sync_every=4)
    expected = whole.finish(SINGLE, 12)
    assert expected["num_samples"] == 96 and expected["resumed_at_step"] is None
    assert expected["train_loss"] == sum(0.5 * s + 0.25 for s in range(1, 13)) / 96

    first = EpochMeter()
    first.start(1, 0)
    _run(first, range(1, 11), sync_every=4)  # killed after step 10: steps 9, 10 are redone
    saved = first.state_dict()
    assert saved["synced_step"] == 8 and saved["totals"][1] == 64
    resumed = EpochMeter()
    resumed.load_state_dict(saved)
    resumed.start(1, 8)
    _run(resumed, range(9, 13), sync_every=4)
    figures = resumed.finish(SINGLE, 12)
    assert figures["train_loss"] == expected["train_loss"]  # the same sums in the same order
    assert figures["num_samples"] == 96
    assert figures["resumed_at_step"] == 8 and figures["whole_epoch"] is True
    assert coverage_note(figures, 12) == " (whole epoch, resumed at step 8)"
    assert coverage_note(expected, 12) == ""

    resumed.start(2, 12)  # the next epoch starts from zero
    assert resumed.totals == [0.0, 0.0, 0.0] and resumed.resumed_at_step is None


def test_a_checkpoint_saved_without_sync_is_said_to_cover_the_resumed_part_only():
    first = EpochMeter()
    first.start(1, 0)
    _run(first, range(1, 7), sync_every=4)  # synced at 4, the checkpoint taken at 6
    resumed = EpochMeter()
    resumed.load_state_dict(first.state_dict())
    resumed.start(1, 6)
    _run(resumed, range(7, 13), sync_every=100)
    figures = resumed.finish(SINGLE, 12)
    assert figures["num_samples"] == 48 and figures["whole_epoch"] is False
    assert coverage_note(figures, 12) == (
        " (steps 7-12 only: resumed at step 6 from a checkpoint without this epoch's sums)"
    )
