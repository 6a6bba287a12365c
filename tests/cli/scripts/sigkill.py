"""Test script: rank 1 dies from SIGKILL after one all-reduce, while rank 0 waits in the next.

    sigkill.py --pid-dir DIR                 # rank 1 SIGKILLs itself (as `kill -9` would)
    sigkill.py --pid-dir DIR --cgroup CG     # rank 1 moves into memory cgroup CG and allocates
                                             # past its limit: the kernel's out-of-memory killer

Rank 1 writes its pid (``rank1.pid``) and the time just before the kill (``killed_at``) into
DIR. Runs under ``ddpkit run -n 2`` and plain ``torchrun --nproc-per-node 2`` alike.
"""

import argparse
import os
import signal
import time
from pathlib import Path

import torch

import ddpkit

parser = argparse.ArgumentParser()
parser.add_argument("--pid-dir", required=True)
parser.add_argument("--cgroup", default=None)
parser.add_argument("--allocate-mib", type=int, default=1024)
args = parser.parse_args()

with ddpkit.init_runtime(init_timeout_s=60, train_timeout_s=60) as rt:
    ddpkit.all_reduce_sum([1.0], rt)
    if rt.rank == 1:
        Path(args.pid_dir, "rank1.pid").write_text(str(os.getpid()))
        Path(args.pid_dir, "killed_at").write_text(repr(time.time()))
        if args.cgroup:  # what it allocates from now on is charged to the cgroup
            Path(args.cgroup, "cgroup.procs").write_text(str(os.getpid()))
            hog = torch.ones(args.allocate_mib * 2**20 // 4)  # every page touched
            print(f"not killed: allocated {hog.numel() * 4 / 2**20:.0f} MiB", flush=True)
        else:
            os.kill(os.getpid(), signal.SIGKILL)
    ddpkit.all_reduce_sum([1.0], rt)
