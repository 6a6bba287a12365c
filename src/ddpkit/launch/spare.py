"""A warm spare of ``ddpkit run --fault-tolerance live --spares N``: a process that has already
imported torch and ddpkit (seconds of start-up, off the critical path) and waits until the
launcher hands it the slot of a worker that was lost; then it runs the target as that worker
would (:mod:`ddpkit.launch.worker`) and heals from a live peer.

    python -m ddpkit.launch.spare script.py [args...]     # started by the launcher only
"""

from __future__ import annotations

import json
import os
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

    import ddpkit
    import ddpkit.launch.worker  # noqa: F401

    api = set(ddpkit._API_MODULES.values())  # import ddpkit imports each name on first use
    for name in [*sorted(api), *filter(None, os.environ.get(PRELOAD_ENV, "").split(","))]:
        importlib.import_module(name)


def slot_environment(slot: int, nproc: int, replica: str, role: str) -> dict[str, str]:
    """The variables of the worker that fills ``slot`` (as ``replica``, in ``role``)."""
    from ddpkit.live.protocol import REPLICA_ENV, SLOT_ENV
    from ddpkit.live.start import ROLE_ENV

    return {
        REPLICA_ENV: replica,
        SLOT_ENV: str(slot),
        ROLE_ENV: role,
        "RANK": str(slot),
        "LOCAL_RANK": str(slot),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
    }


def main() -> None:
    from ddpkit.launch.worker import die_with_launcher

    die_with_launcher()
    _warm_up()
    import torch.distributed as dist

    from ddpkit.live.protocol import STORE_ENV, key

    host, _, port = os.environ[STORE_ENV].rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False)
    name = key("activate", os.environ[SPARE_ENV])
    while not store.check([name]):
        time.sleep(POLL_S)
    record = json.loads(store.get(name))
    os.environ.update(
        slot_environment(record["slot"], record["nproc"], record["replica"], "replacement")
    )
    del store
    from ddpkit.launch import worker

    worker.main()


if __name__ == "__main__":
    main()
