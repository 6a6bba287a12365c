"""Test script: write 1 MiB of state where it may not fit, and print what was raised.

    full_disk_save.py io DIR              # write_checkpoint and probe_write_s, one process
    full_disk_save.py ddp|fsdp DIR        # CheckpointManager.save(1) of a model (2 ranks): ddp
                                          # rank 0 writes; fsdp every rank its shard

``io`` prints one JSON line per call: the exception's type, errno, message, whether it carries
the time it failed (for the launcher's "first failure"), and the folder's contents after
it (None: empty or gone).
"""

import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

import ddpkit
from ddpkit.checkpoint.io import probe_write_s, write_checkpoint

mode, directory = sys.argv[1], Path(sys.argv[2])
if mode == "io":
    state = {"model": {"weight": torch.zeros(512, 512)}}  # 1 MiB of float32
    calls = {
        "probe": lambda: probe_write_s(directory, state),
        "write": lambda: write_checkpoint(directory, 4, state, {}),
    }
    for name, call in calls.items():
        try:
            call()
        except Exception as exc:
            stamped = getattr(exc, "ddpkit_failed_at_s", None)  # the failure's own time
            print(
                json.dumps(
                    {
                        "call": name,
                        "type": type(exc).__name__,
                        "errno": getattr(exc, "errno", None),
                        "message": str(exc),
                        "stamped": stamped is not None and stamped <= time.time(),
                        "left_behind": sorted(p.name for p in directory.glob("*")) or None,
                    }
                ),
                flush=True,
            )
else:
    with ddpkit.init_runtime(init_timeout_s=60, train_timeout_s=60) as rt:
        model = nn.Sequential(nn.Linear(512, 256), nn.Linear(256, 512))  # 1 MiB of float32
        model = ddpkit.wrap_model(model, rt, strategy=mode)
        try:
            ddpkit.CheckpointManager(directory, rt, state={"model": model}).save(1)
        finally:
            if rt.rank == 0:  # its own teardown (trackers, log files: rank 0's alone) takes
                time.sleep(1.0)  # longer than rank 1's, which has none
