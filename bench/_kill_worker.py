"""Rank script for bench/fault_trials.py: all-reduce in a loop; one rank SIGKILLs itself.

ddpkit run -n 2 bench/_kill_worker.py VICTIM_RANK KILL_STEP STAMP_FILE
"""

import os
import signal
import sys
import time

import ddpkit

victim, kill_step, stamp = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
with ddpkit.init_runtime(init_timeout_s=60, train_timeout_s=1800) as rt:
    for step in range(10_000):
        if rt.rank == victim and step == kill_step:
            with open(stamp, "w") as handle:
                handle.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        ddpkit.all_reduce_sum([1.0], rt)
        time.sleep(0.01)
