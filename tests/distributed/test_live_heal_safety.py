"""Live healing sends the state as torch.save bytes read with the checkpoint allow-list: a
peer (or whoever answers at a forged gloo address) cannot run code in a replacement."""

from __future__ import annotations

import os

import numpy as np
import torch

from ddpkit.errors import DataError
from ddpkit.live.heal import all_gather_safely, broadcast_safely
from ddpkit.testing import run_distributed


class _Payload:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _send(runtime, marker: str) -> dict:
    state = {"step": 7, "w": torch.arange(4.0), "rng": np.random.default_rng(0).random(3)}
    got = broadcast_safely(state if runtime.rank == 0 else None)
    gathered = all_gather_safely({"rank": runtime.rank, "rng": torch.get_rng_state()})
    try:
        broadcast_safely(_Payload(marker) if runtime.rank == 0 else None)
        refused = ""
    except DataError as exc:
        refused = str(exc)
    return {"got": got, "ranks": [g["rank"] for g in gathered], "refused": refused}


def test_the_state_arrives_and_a_payload_is_refused(tmp_path):
    marker = tmp_path / "payload-ran"
    results = run_distributed(_send, 2, args=(str(marker),))
    for result in results:
        assert result["got"]["step"] == 7
        assert torch.equal(result["got"]["w"], torch.arange(4.0))
        assert np.array_equal(result["got"]["rng"], np.random.default_rng(0).random(3))
        assert result["ranks"] == [0, 1]
    assert results[0]["refused"] == ""  # the sender keeps its own object
    assert "unsafe checkpoint" in results[1]["refused"]
    assert "mkdir" in results[1]["refused"], results[1]["refused"]
    assert not marker.exists()
