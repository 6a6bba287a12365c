"""Cost of the global data position: the first batch of a pass that resumes mid-epoch.

    OMP_NUM_THREADS=1 python bench/resume_position.py --repeats 21

A fresh pass runs torch's own ``DistributedSampler`` code unchanged; only a pass that resumes
inside an epoch takes the global-cursor path (the epoch's permutation drawn once by a
one-replica ``DistributedSampler``, then rank r's positions picked). One process plays rank 1 of
a world of 2 (no process group: the sampler's work is the same), over 60,000 MNIST-shaped
indices, batch 64. Interleaved A B C, medians of the time to the first batch:

A. a fresh pass (torch's path);
B. a pass resumed at the same world size (the global path; what any resumed pass costs now);
C. a pass resumed at world size 3 from a position of world size 2.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.env import ProcessInfo
from ddpkit.runtime.process_group import Runtime

NUM_SAMPLES, BATCH = 60_000, 64


def _loader(rank: int, world_size: int, data: TensorDataset) -> ddpkit.ShardedLoader:
    info = ProcessInfo(
        rank=rank, world_size=world_size, local_world_size=world_size, local_rank=rank
    )
    rt = Runtime(info, backend=None, device=torch.device("cpu"))
    return ddpkit.build_train_loader(data, rt, batch_size=BATCH, seed=0)


def _first_batch_s(loader: ddpkit.ShardedLoader, state: dict | None) -> float:
    if state is not None:
        loader.load_state_dict(state)
    else:
        loader.set_epoch(0)
    start = time.perf_counter()
    passed = iter(loader)
    next(passed)
    elapsed = time.perf_counter() - start
    passed.close()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    data = TensorDataset(torch.zeros(NUM_SAMPLES, 1))  # the sampler's cost, not the data's
    two, three = _loader(1, 2, data), _loader(1, 3, data)
    half = {"epoch": 0, "samples_done": 30_016, "epoch_samples": NUM_SAMPLES}
    times: dict[str, list[float]] = {"fresh": [], "resumed_same": [], "resumed_resized": []}
    for _ in range(args.repeats):
        times["fresh"].append(_first_batch_s(two, None))
        times["resumed_same"].append(_first_batch_s(two, dict(half)))
        times["resumed_resized"].append(_first_batch_s(three, dict(half)))
    fresh = statistics.median(times["fresh"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:16s} first batch {1000 * median:7.2f} ms  ({median / fresh:.2f}x fresh)")


if __name__ == "__main__":
    main()
