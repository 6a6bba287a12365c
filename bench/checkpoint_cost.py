"""Save and load time and size of a ``ddpkit train`` checkpoint (MNIST CNN + Adam state).

    python bench/checkpoint_cost.py --repeats 20

One process, world size 1: the cost of writing (serialise, fsync, checksum, rename) and of
reading back (read, verify the checksum, unpickle, load into model/optimizer). Medians.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.nn import functional as F

import ddpkit
from ddpkit.app.mnist.model import MnistCNN
from ddpkit.env import ProcessInfo
from ddpkit.runtime.process_group import Runtime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    rt = Runtime(ProcessInfo())
    model = MnistCNN()
    optimizer = torch.optim.Adam(model.parameters())
    F.cross_entropy(model(torch.randn(8, 1, 28, 28)), torch.zeros(8, dtype=torch.long)).backward()
    optimizer.step()  # so the optimizer holds its moment estimates
    save_s, load_s = [], []
    with tempfile.TemporaryDirectory() as tmp:
        state = {"model": model, "optimizer": optimizer}
        ckpt = ddpkit.CheckpointManager(tmp, rt, state=state, keep_last=2)
        for step in range(1, args.repeats + 1):
            start = time.perf_counter()
            folder = ckpt.save(step)
            save_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            ckpt.resume()
            load_s.append(time.perf_counter() - start)
        size_mib = sum(p.stat().st_size for p in Path(folder).iterdir()) / 2**20
    params = sum(p.numel() for p in model.parameters())
    print(
        f"MNIST CNN ({params:,} parameters) + Adam state: checkpoint {size_mib:.2f} MiB; "
        f"save median {1000 * statistics.median(save_s):.1f} ms, "
        f"load median {1000 * statistics.median(load_s):.1f} ms "
        f"({args.repeats} repeats, torch {torch.__version__})"
    )


if __name__ == "__main__":
    main()
