"""A checkpoint runs no code when loaded (issue 27 §2): the attacks tried, each refused.

The payload is an object whose unpickling creates a marker file (``open(marker, "w")``): the
marker's absence is the proof that nothing ran. The attacker rewrites the manifest's SHA-256
along with the file, as anyone who can write the folder can. ``unsafe_pickle=True`` is shown to
run it: the opt-in is exactly as unsafe as it says.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import ddpkit
from ddpkit.checkpoint.io import MANIFEST, STATE_FILE
from ddpkit.checkpoint.sharded import load_in_this_process, safe_reader
from ddpkit.env import ProcessInfo
from tests.helpers import run_cli


class Payload:
    """Unpickling it calls ``open(marker, "w")``: code of the attacker's choosing."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _runtime() -> ddpkit.Runtime:
    return ddpkit.Runtime(ProcessInfo())


def _manager(directory: Path, **kwargs) -> ddpkit.CheckpointManager:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return ddpkit.CheckpointManager(
        directory, _runtime(), state={"model": model, "optimizer": opt}, **kwargs
    )


def _rewrite_manifest(folder: Path, name: str, **fields) -> None:
    manifest = json.loads((folder / MANIFEST).read_text())
    digest = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    manifest["files"][name] = digest
    manifest.update(fields)
    (folder / MANIFEST).write_text(json.dumps(manifest))


def _poisoned_checkpoint(tmp_path: Path) -> tuple[Path, Path]:
    """A real checkpoint whose state.pt also holds the payload, its manifest rewritten."""
    _manager(tmp_path / "ckpt").save(5)
    folder = tmp_path / "ckpt" / "step-00000005"
    state = torch.load(folder / STATE_FILE, weights_only=False)
    marker = tmp_path / "PWNED"
    state["state"]["model"]["evil"] = Payload(marker)
    torch.save(state, folder / STATE_FILE)
    _rewrite_manifest(folder, STATE_FILE)
    return folder, marker


def test_a_poisoned_state_file_is_refused_by_resume_and_runs_nothing(tmp_path, caplog):
    folder, marker = _poisoned_checkpoint(tmp_path)
    with pytest.raises(ddpkit.DataError) as info:
        _manager(tmp_path / "ckpt").resume(folder)  # a PATH: refused
    assert str(info.value).startswith(
        f"unsafe checkpoint: path={folder / STATE_FILE} holds the global io.open, which is not "
        "on the allow-list"
    ), info.value
    assert "unsafe_pickle=True" in str(info.value)
    assert _manager(tmp_path / "ckpt").resume() == 0  # auto: skipped like a corrupt one
    assert "skipping checkpoint step-00000005: unsafe checkpoint" in caplog.text
    assert not marker.exists()
    folder = tmp_path / "ckpt" / "set-aside" / folder.name  # kept, out of the resume's way
    with pytest.raises(ddpkit.DataError, match="1 not in the model: evil"):  # loaded: unpickled
        _manager(tmp_path / "ckpt", unsafe_pickle=True).resume(folder)
    assert marker.exists()  # the opt-in runs the payload: it is named unsafe for that reason


@pytest.mark.slow  # a process importing torch: out of the inner loop
def test_checkpoint_export_refuses_the_poisoned_state_in_one_line(tmp_path):
    folder, marker = _poisoned_checkpoint(tmp_path)
    done = run_cli(
        [
            "-m",
            "ddpkit",
            "checkpoint",
            "export",
            str(folder),
            "--output",
            str(tmp_path / "model.pt"),
        ],
        timeout_s=60,
    )
    assert done.returncode != 0
    assert done.returncode == 2 and "error: unsafe checkpoint: path=" in done.stderr
    assert "holds the global io.open" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert not marker.exists()


def test_a_manifest_of_an_unknown_format_is_refused(tmp_path):
    _manager(tmp_path / "ckpt").save(3)
    folder = tmp_path / "ckpt" / "step-00000003"
    _rewrite_manifest(folder, STATE_FILE, format=99)
    with pytest.raises(
        ddpkit.DataError,
        match=r"checkpoint of an unknown format: path=.*"
        r"format=99; this ddpkit reads formats 1, 2",
    ):
        _manager(tmp_path / "ckpt").resume(folder)


def _dcp_folder(tmp_path: Path, extra: object) -> Path:
    """A DCP checkpoint (as ddpkit's sharded saves write one), in this process."""
    folder = tmp_path / "sharded"
    dcp.save({"w": torch.ones(3), "extra": extra}, checkpoint_id=folder / "dcp", no_dist=True)
    return folder


def test_a_poisoned_dcp_metadata_is_refused_before_torch_reads_it(tmp_path):
    folder = _dcp_folder(tmp_path, 0.1)
    marker = tmp_path / "PWNED"
    metadata = folder / "dcp" / ".metadata"
    metadata.write_bytes(pickle.dumps(Payload(marker)))
    reader, _ = safe_reader(folder)
    with pytest.raises(ddpkit.DataError, match="holds the global io.open in its DCP metadata"):
        reader.read_metadata()
    assert not marker.exists()
    torch_reader, _ = safe_reader(folder, unsafe_pickle=True)  # torch's own reader: it runs
    with contextlib.suppress(Exception):  # the payload ran; what torch does next may fail
        torch_reader.read_metadata()
    assert marker.exists()


def test_a_poisoned_value_inside_the_dcp_shards_is_refused(tmp_path):
    marker = tmp_path / "PWNED"
    folder = _dcp_folder(tmp_path, Payload(marker))
    assert not marker.exists()  # pickled, not run
    template = {"w": torch.zeros(3), "extra": ""}  # a non-tensor: read from its bytes
    reader, planner = safe_reader(folder)
    with pytest.raises(ddpkit.DataError, match="holds the global io.open"):
        load_in_this_process(template, reader, planner)
    assert not marker.exists()
    good = _dcp_folder(tmp_path / "good", 0.1)  # an optimizer's lr, say
    template = {"w": torch.zeros(3), "extra": ""}
    load_in_this_process(template, *safe_reader(good))  # plain values load as before
    assert torch.equal(template["w"], torch.ones(3))
    assert template["extra"] == 0.1
