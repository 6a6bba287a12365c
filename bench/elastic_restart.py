"""Time from a lost node to training resumed on the others: ``ddpkit run`` against plain torchrun.

    OMP_NUM_THREADS=1 .venv/bin/python bench/elastic_restart.py --repeats 5   # as root

3 nodes x 1 process, network namespaces on one private switch (as in ``tests/multinode``), the
README-pattern loop of ``tests/multinode/scripts/elastic_train.py`` under ``--nnodes 2:3``.
Once the job reports a checkpoint at step 8, every process of node 2 is SIGKILLed; measured from
that moment:

- ``rendezvous_s``: the first process of the new 2-rank worker group created (the survivors'
  workers failed, their agents waited for torch's rendezvous to drop the dead node,
  ``keep_alive_interval`` x ``keep_alive_max_attempt``, and for ``last_call_timeout``);
- ``resumed_s``: that group's first training step (plus interpreter start, imports,
  ``init_runtime``, the checkpoint load).

Interleaved (ddpkit, torchrun) per repeat, medians; with torch's rendezvous timings (``torch``)
and with the short ones the tests use (``short``). Plain torchrun is told what ddpkit works out
itself (``--local-addr``, ``GLOO_SOCKET_IFNAME``, ``is_host`` on node 0).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.multinode helpers

import torch  # noqa: E402
from tests.multinode.elastic_job import (  # noqa: E402
    RDZV_CONF,
    read_events,
    saved,
    start_ddpkit,
    start_torchrun,
    wait_for,
)
from tests.multinode.netns import kill_node, switched_nodes  # noqa: E402

SETTINGS = {"torch": "", "short": RDZV_CONF}


def _trial(mode: str, rdzv_conf: str) -> dict[str, float]:
    """One job: start 3 nodes, lose node 2 after the step-8 checkpoint, time the recovery."""
    with switched_nodes(3) as nodes, tempfile.TemporaryDirectory() as out:
        job = [out, "1000", "0.1"]  # never finishes on its own: the namespaces end it
        if mode == "ddpkit":
            procs = [start_ddpkit(n, r, nodes[0], job, rdzv_conf) for r, n in enumerate(nodes)]
        else:
            procs = [start_torchrun(n, nodes[0], job, rdzv_conf) for n in nodes]
        wait_for(Path(out), procs, "a checkpoint on 3 ranks", saved(3, 8), timeout_s=240)
        kill_node(nodes[2])
        killed_s = time.time()
        events = wait_for(
            Path(out),
            procs[:2],
            "a step on 2 ranks",
            lambda evs: any(e["event"] == "step" and e["world_size"] == 2 for e in evs),
            timeout_s=300,
        )
        starts = [e for e in read_events(Path(out)) if e["attempt"][0] == 2]
        first_step = min(
            e["time_s"] for e in events if e["event"] == "step" and e["world_size"] == 2
        )
        created = min(e["process_start_s"] for e in starts if e["event"] == "start")
        return {"rendezvous_s": created - killed_s, "resumed_s": first_step - killed_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {}
    for repeat in range(args.repeats):
        for setting in args.settings:
            for mode in ("ddpkit", "torchrun"):
                trial = _trial(mode, SETTINGS[setting])
                results.setdefault(f"{setting}/{mode}", []).append(trial)
                print(
                    f"repeat {repeat} {setting:5} {mode:8} "
                    + " ".join(f"{k} {v:.1f}" for k, v in trial.items()),
                    flush=True,
                )
    print(
        f"\n{os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}"
    )
    summary = {}
    for key, trials in results.items():
        summary[key] = {k: statistics.median(t[k] for t in trials) for k in trials[0]}
        print(f"{key:16} median " + " ".join(f"{k} {v:.1f}" for k, v in summary[key].items()))
    for setting in args.settings:
        ours, theirs = summary[f"{setting}/ddpkit"], summary[f"{setting}/torchrun"]
        ratio = ours["resumed_s"] / theirs["resumed_s"]
        print(f"{setting}: ddpkit/torchrun resumed_s ratio {ratio:.2f}")
    print(json.dumps({"repeats": args.repeats, "medians": summary}))


if __name__ == "__main__":
    main()
