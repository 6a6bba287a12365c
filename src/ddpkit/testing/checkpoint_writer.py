"""A process that saves checkpoints in a loop, to be killed at random moments by a test.

    python -m ddpkit.testing.checkpoint_writer DIR [--mnist]

Resumes from the newest checkpoint in DIR, prints ``ready``, then saves step after step
(keep_last=2) until it is killed. Used by the kill-safety test and ``bench/fault_trials.py``.
"""

from __future__ import annotations

import sys

import torch

from ddpkit.checkpoint.manager import CheckpointManager
from ddpkit.env import ProcessInfo
from ddpkit.runtime.process_group import Runtime


def main(argv: list[str]) -> None:
    if "--mnist" in argv:
        from ddpkit.app.mnist.model import MnistCNN

        model: torch.nn.Module = MnistCNN()
    else:
        model = torch.nn.Linear(256, 256)
    runtime = Runtime(ProcessInfo())
    ckpt = CheckpointManager(argv[0], runtime, state={"model": model}, keep_last=2)
    step = ckpt.resume()
    print("ready", flush=True)
    while True:
        step += 1
        ckpt.save(step)


if __name__ == "__main__":
    main(sys.argv[1:])
