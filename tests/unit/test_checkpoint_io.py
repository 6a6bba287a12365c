"""Checkpoint files: atomic folders, checksum fallback, prefix-tolerant loading, kill-safety."""

from __future__ import annotations

import logging
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.checkpoint.io import list_checkpoints, load_checkpoint
from ddpkit.env import ProcessInfo
from ddpkit.errors import DataError
from ddpkit.runtime.process_group import Runtime
from tests.helpers import run_main


def _runtime() -> Runtime:
    return Runtime(ProcessInfo())


def _save_steps(directory, steps, keep_last=5):
    model = nn.Linear(3, 2)
    ckpt = ddpkit.CheckpointManager(
        directory, _runtime(), state={"model": model}, keep_last=keep_last
    )
    for step in steps:
        with torch.no_grad():
            model.weight.fill_(step)
        ckpt.save(step)
    return ckpt, model


def test_keep_last_and_no_module_prefix(tmp_path):
    _save_steps(tmp_path, [1, 2, 3, 4], keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000004", "step-00000003"]
    state = load_checkpoint(tmp_path / "step-00000004")
    assert set(state["state"]["model"]) == {"weight", "bias"}
    assert state["step"] == 4 and state["world_size"] == 1


def test_corrupt_newest_falls_back_to_previous_and_says_so(tmp_path, capsys):
    ckpt, model = _save_steps(tmp_path, [10, 20])
    newest = tmp_path / "step-00000020" / "state.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern in the middle
    newest.write_bytes(bytes(data))
    with pytest.raises(DataError, match="corrupt checkpoint"):
        ckpt.resume(tmp_path / "step-00000020")
    ddpkit.configure_logging(ProcessInfo())
    assert ckpt.resume() == 10
    assert model.weight.detach()[0, 0].item() == 10.0
    err = capsys.readouterr().err
    assert "skipping checkpoint step-00000020: corrupt checkpoint" in err
    assert "Falling back to the previous one" in err
    # out of the way of later saves and resumes, never deleted (a read error may be transient)
    aside = tmp_path / "set-aside" / "step-00000020"
    assert not (tmp_path / "step-00000020").exists() and (aside / "state.pt").read_bytes() == data
    assert "checkpoint step-00000020 (unreadable: corrupt checkpoint" in err
    assert f"moved to {aside}: nothing was deleted" in err
    for step in (11, 12, 13, 14, 15, 16):  # keep_last=5: pruning never reaches the set-aside one
        ckpt.save(step)
    assert (aside / "state.pt").read_bytes() == data
    with pytest.raises(DataError, match="corrupt checkpoint"):  # still what it was
        ckpt.resume(aside)


def test_no_readable_checkpoint_starts_at_0_and_sets_every_one_aside(tmp_path, capsys):
    ckpt, model = _save_steps(tmp_path, [10, 20])
    for step in (10, 20):
        (tmp_path / f"step-{step:08d}" / "state.pt").write_bytes(b"torn")
    ddpkit.configure_logging(ProcessInfo())
    assert ckpt.resume() == 0
    assert sorted(p.name for p in (tmp_path / "set-aside").iterdir()) == [
        "step-00000010",
        "step-00000020",
    ]
    assert list_checkpoints(tmp_path) == []
    assert capsys.readouterr().err.count("nothing was deleted") == 2


def test_resuming_an_older_checkpoint_sets_the_newer_ones_aside(tmp_path):
    ckpt, model = _save_steps(tmp_path, [10, 20])
    assert ckpt.resume(tmp_path / "step-00000010") == 10
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000010"]
    assert load_checkpoint(tmp_path / "set-aside" / "step-00000020")["step"] == 20
    ckpt.save(20)  # the new history's step 20 beside the set-aside one
    assert ckpt.resume() == 20
    assert load_checkpoint(tmp_path / "set-aside" / "step-00000020")["step"] == 20


def test_incomplete_folder_without_manifest_is_skipped(tmp_path):
    ckpt, model = _save_steps(tmp_path, [5])
    (tmp_path / "step-00000009").mkdir()
    (tmp_path / "step-00000009" / "state.pt").write_bytes(b"half")
    assert ckpt.resume() == 5


def test_load_model_state_accepts_module_prefix_and_refuses_no_match():
    model = nn.Linear(3, 2)
    prefixed = {f"module.{k}": torch.ones_like(v) for k, v in model.state_dict().items()}
    ddpkit.load_model_state(model, prefixed)
    assert torch.equal(model.weight, torch.ones(2, 3))
    with pytest.raises(DataError, match="matches no parameter"):
        ddpkit.load_model_state(model, {"encoder.w": torch.ones(1)}, strict=False)


def test_another_world_size_resumes_and_says_so_naming_both(tmp_path, caplog):
    _save_steps(tmp_path, [3])
    two = Runtime(ProcessInfo(rank=0, world_size=2, local_world_size=2))
    fresh = nn.Linear(3, 2)
    with caplog.at_level(logging.INFO, logger="ddpkit"):
        step = ddpkit.CheckpointManager(tmp_path, two, state={"model": fresh}).resume()
    assert step == 3 and torch.equal(fresh.weight, torch.full((2, 3), 3.0))
    assert "(step 3) on 2 ranks, written by 1: the data goes on at the saved sample" in caplog.text


@pytest.mark.slow
def test_killing_the_writer_never_leaves_an_unloadable_newest(tmp_path):
    rng = random.Random(0)
    for trial in range(5):  # bench/fault_trials.py runs 20
        proc = subprocess.Popen(
            [sys.executable, "-m", "ddpkit.testing.checkpoint_writer", str(tmp_path)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 30
        while trial == 0 and not list(tmp_path.glob("step-*/manifest.json")):  # an empty folder:
            assert time.monotonic() < deadline, "no save completed in 30 s"  # one save first
            time.sleep(0.01)
        time.sleep(rng.uniform(0.05, 0.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        ckpt = ddpkit.CheckpointManager(tmp_path, _runtime())
        found = ckpt.load_latest()
        assert found is not None, f"trial {trial}: no loadable checkpoint"
        newest_complete = [p for p in list_checkpoints(tmp_path) if (p / "manifest.json").exists()]
        assert found[0] == newest_complete[0]  # the newest complete one loads, no fallback needed
        del ckpt  # the folder's lock goes with it: the next writer may take the folder


def test_every_steps_and_every_epochs(tmp_path):
    model = nn.Linear(2, 2)
    ckpt = ddpkit.CheckpointManager(
        tmp_path, _runtime(), state={"model": model}, keep_last=10, every_steps=3, every_epochs=2
    )
    saved = [s for s in range(1, 8) if ckpt.maybe_save(s)]
    saved += [100 + e for e in range(1, 5) if ckpt.maybe_save_epoch(e, step=100 + e)]
    assert saved == [3, 6, 102, 104]
    with pytest.raises(ddpkit.ConfigError, match="keep_last=0"):
        ddpkit.CheckpointManager(tmp_path, _runtime(), keep_last=0)


def test_export_of_a_folder_falls_back_past_a_corrupt_newest_as_resume_does(tmp_path, capsys):
    _save_steps(tmp_path / "ck", [10, 20])
    (tmp_path / "ck" / "step-00000020" / "state.pt").write_bytes(b"torn")
    out = tmp_path / "model.pt"
    export = ["checkpoint", "export", str(tmp_path / "ck"), "--output", str(out)]
    code, err = run_main(export, capsys)
    assert code == 0, err
    assert "ddpkit checkpoint export: skipping step-00000020: corrupt checkpoint" in err
    assert torch.equal(torch.load(out)["weight"], torch.full((2, 3), 10.0))
    (tmp_path / "ck" / "step-00000010" / "state.pt").write_bytes(b"torn")  # none reads: refused
    code, err = run_main(export, capsys)
    assert code == 2 and "error: corrupt checkpoint" in err
    assert "step-00000020" in err.splitlines()[-1]  # the newest one's error
