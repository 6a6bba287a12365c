"""Test script for the launcher: reports its rank, logs, and fails on request.

probe.py [--fail-rank R] [--pid-dir DIR] [--warn-rank R] [--finish-rank R] ...
"""

import argparse
import os
import signal
import sys
import time

import ddpkit

parser = argparse.ArgumentParser()
parser.add_argument("--fail-rank", type=int, default=-1)
parser.add_argument("--warn-rank", type=int, default=-1)
parser.add_argument("--exit-rank", type=int, default=-1, help="sys.exit(3) on this rank")
parser.add_argument("--kill-rank", type=int, default=-1, help="SIGKILL itself at step 3")
parser.add_argument("--steps", type=int, default=1, help="all-reduces after the checks")
parser.add_argument("--finish-rank", type=int, default=-1, help="skips those all-reduces, exit 0")
parser.add_argument("--pid-dir", default=None)
args = parser.parse_args()

with ddpkit.init_runtime(init_timeout_s=60, train_timeout_s=120) as rt:
    if args.pid_dir:
        with open(os.path.join(args.pid_dir, f"rank{rt.rank}.pid"), "w") as handle:
            handle.write(str(os.getpid()))
    ddpkit.configure_logging(rt.info)
    log = ddpkit.get_logger("probe")
    print(f"PROBE rank={rt.rank} world_size={rt.world_size} local_rank={rt.local_rank}", flush=True)
    log.info("info message from the probe")
    if rt.rank == args.warn_rank:
        log.warning("warning message from rank %d", rt.rank)
    total = ddpkit.all_reduce_sum([1.0], rt).item()
    print(f"PROBE rank={rt.rank} sum={total:.0f}", flush=True)
    if rt.rank == args.fail_rank:
        time.sleep(0.5)  # let the others enter the collective first
        raise ValueError("boom")
    if rt.rank == args.exit_rank:
        time.sleep(0.5)
        sys.exit(3)
    for step in range(args.steps if rt.rank != args.finish_rank else 0):  # a failing rank's
        if rt.rank == args.kill_rank and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        ddpkit.all_reduce_sum([1.0], rt)
        time.sleep(0.1)
