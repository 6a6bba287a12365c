"""A warm spare of ``ddpkit run --fault-tolerance live --spares N``: a process that has already
imported torch and ddpkit (seconds of start-up, off the critical path) and waits until the
launcher hands it the slot of a worker that was lost; then it runs the target as that worker
would (:mod:`ddpkit.launch.worker`) and heals from a live peer.

    python -m ddpkit.launch.spare script.py [args...]     # started by the launcher only
"""

from __future__ import annotations

import json
import os
import sys
import time

SPARE_ENV = "DDPKIT_LIVE_SPARE"
PRELOAD_ENV = "DDPKIT_LIVE_PRELOAD"  # modules the target imports (ddpkit train: its job's)
POLL_S = 0.02


def _warm_up() -> None:
    """Import what every worker imports, and the modules the launcher names."""
    import importlib

    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.nn.functional  # noqa: F401

    import ddpkit  # noqa: F401
    import ddpkit.checkpoint.manager  # noqa: F401
    import ddpkit.launch.worker  # noqa: F401

    for name in filter(None, os.environ.get(PRELOAD_ENV, "").split(",")):
        importlib.import_module(name)


def main() -> None:
    from ddpkit.launch.worker import die_with_launcher

    die_with_launcher()
    _warm_up()
    import torch.distributed as dist

    from ddpkit.live.protocol import REPLICA_ENV, SLOT_ENV, STORE_ENV, key
    from ddpkit.live.start import ROLE_ENV

    host, _, port = os.environ[STORE_ENV].rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False)
    name = key("activate", os.environ[SPARE_ENV])
    while not store.check([name]):
        time.sleep(POLL_S)
    record = json.loads(store.get(name))
    slot = str(record["slot"])
    os.environ.update({
        REPLICA_ENV: record["replica"], SLOT_ENV: slot, ROLE_ENV: "replacement",
        "RANK": slot, "LOCAL_RANK": slot,
        "WORLD_SIZE": str(record["nproc"]), "LOCAL_WORLD_SIZE": str(record["nproc"]),
    })  # fmt: skip
    del store
    from ddpkit.launch import worker

    worker.main()


if __name__ == "__main__":
    main()
