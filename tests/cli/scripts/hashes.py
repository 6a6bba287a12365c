"""Test script for per-process string hashing: each rank prints its hash seed, ``hash("abc")``,
the class ids ``list(set(labels))`` gives it, and the runtime's verdict.

    ddpkit run -n 2 tests/cli/scripts/hashes.py
    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/cli/scripts/hashes.py
"""

import json
import os

import ddpkit

LABELS = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]

with ddpkit.init_runtime(init_timeout_s=60, train_timeout_s=60) as rt:
    class_ids = {name: index for index, name in enumerate(list(set(LABELS)))}
    report = {
        "rank": rt.rank,
        "seed": os.environ.get("PYTHONHASHSEED"),
        "hash": hash("abc"),
        "ids": class_ids,
        "agree": rt.str_hashes_agree,
    }
    line = "HASHES " + json.dumps(report, sort_keys=True) + "\n"
    os.write(1, line.encode())  # one write: plain torchrun's ranks (python -u) share the pipe
