"""What the watchdog costs when nothing is wrong: one heartbeat, and its share of a training step.

    python bench/watchdog_cost.py --ticks 2000
    python bench/watchdog_cost.py --ticks 2000 --pairs 3 --data-dir ../shared/data/mnist

Part 1 (one process, a TCPStore on 127.0.0.1 port chosen by the OS): the training thread runs a
small torch loop while the bench times ``--ticks`` heartbeats of the watchdog from another
thread, as its own thread would run them once a second: sampling and classifying the training
thread's stack (``locate``), writing the heartbeat, checking for requests. Prints the median and
p99 microseconds per heartbeat, and that cost as a share of one second (the interval).

Part 2 (with ``--data-dir``): ``ddpkit train --nproc 2 --max-steps 200`` with the watchdog on
(``--stall-timeout 300``, the default) and off (``--stall-timeout 0``), interleaved ``--pairs``
times; median samples/s of each and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ddpkit.env import ProcessInfo
from ddpkit.watchdog.monitor import Watchdog
from ddpkit.watchdog.position import locate


def heartbeat_cost(num_ticks: int) -> None:
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    info = ProcessInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, source="torchrun")
    watchdog = Watchdog(store, info)  # not started: the bench calls its heartbeat itself
    stop = threading.Event()

    def train() -> None:  # the thread the watchdog samples
        layer = torch.nn.Linear(64, 64)
        while not stop.is_set():
            layer(torch.randn(32, 64)).sum().backward()

    trainer = threading.Thread(target=train)
    trainer.start()
    watchdog._thread_id = trainer.ident
    ticks, locates = [], []
    try:
        for _ in range(num_ticks):
            start = time.perf_counter()
            watchdog._tick()
            ticks.append(time.perf_counter() - start)
            start = time.perf_counter()
            locate(sys._current_frames()[trainer.ident], idle=False)
            locates.append(time.perf_counter() - start)
    finally:
        stop.set()
        trainer.join()
    for name, values in (
        ("heartbeat (sample + store write + request check)", ticks),
        ("of which the stack sample (locate)", locates),
    ):
        values.sort()
        median, p99 = values[len(values) // 2], values[int(len(values) * 0.99)]
        print(
            f"{name:52s} median {median * 1e6:7.1f} us  p99 {p99 * 1e6:7.1f} us  "
            f"= {median * 100:.4f}% of each 1 s interval"
        )


def train_rate(data_dir: str, on: bool, out: Path) -> float:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "ddpkit",
            "train",
            "--nproc",
            "2",
            "--data-dir",
            data_dir,
            "--max-steps",
            "200",
            "--output-dir",
            str(out),
            "--stall-timeout",
            "300" if on else "0",
        ],
        check=True,
        capture_output=True,
        env=dict(os.environ),
    )
    return json.loads((out / "summary.json").read_text())["samples_per_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ticks", type=int, default=2000)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()
    heartbeat_cost(args.ticks)
    if args.data_dir is None:
        return 0
    rates: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            for on in (pair % 2 == 0, pair % 2 == 1):  # alternate which goes first
                rates[on].append(train_rate(args.data_dir, on, Path(tmp) / "run"))
    off, on = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"ddpkit train, watchdog off: {off:.0f} samples/s  {rates[False]}")
    print(f"ddpkit train, watchdog on:  {on:.0f} samples/s  {rates[True]}  ratio {on / off:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
