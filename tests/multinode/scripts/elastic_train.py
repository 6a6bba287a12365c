"""The README's own loop, elastic: it logs what every process trains, for the sample count.

    ddpkit run -n 1 --nnodes 2:3 --node-rank R --rdzv-endpoint HOST:PORT \\
        elastic_train.py OUT_DIR EPOCHS STEP_S [SHRUNK_STEP_S]
    torchrun --nnodes 2:3 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        elastic_train.py OUT_DIR EPOCHS STEP_S [SHRUNK_STEP_S]

Each process appends JSON lines to ``OUT_DIR/log-<pid>.jsonl``: ``start`` (rank, world size,
torchrun's restart count, the step ``resume()`` returned, when the process was created),
``step`` (epoch, step, the indices of the samples this rank trained on), ``saved`` (a complete
checkpoint's step), ``done``. STEP_S paces the loop (seconds per step), so a node can be lost
mid-epoch; SHRUNK_STEP_S (default STEP_S) paces it while fewer than 3 ranks train, so that a
node started again has time to join before the shrunk job ends; while ``OUT_DIR/hold`` exists
either pace is 4 times slower (the test holds the job back while the node joins, and while it
reads the rejoined job's sockets).
Checkpoints go to ``OUT_DIR/checkpoints`` every 4 steps; a restarted process resumes from the
newest one on whatever number of ranks the rendezvous gave it.
"""

import json
import os
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit


def process_start_s() -> float:
    """When this process was created (Linux ``/proc``), seconds since the epoch."""
    ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
    boot = next(int(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


OUT, EPOCHS, STEP_S = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
SHRUNK_STEP_S = float(sys.argv[4]) if len(sys.argv) > 4 else STEP_S
# 360 = 20 steps of 6 x 3 ranks = 30 of 6 x 2: a multiple of 6 samples is done at every step,
# so whatever is left of an epoch at a resume splits evenly over 2 or 3 ranks (no padding)
NUM_SAMPLES, BATCH, EVERY_STEPS = 360, 6, 4
x = torch.randn(NUM_SAMPLES, 8, generator=torch.Generator().manual_seed(0))
data = TensorDataset(x, x.argmax(dim=1), torch.arange(NUM_SAMPLES))  # the index rides along

with ddpkit.init_runtime("gloo", init_timeout_s=60, train_timeout_s=30) as rt:
    log = open(os.path.join(OUT, f"log-{os.getpid()}.jsonl"), "a", buffering=1)

    def note(event: str, **fields: object) -> None:
        fields.update(event=event, rank=rt.rank, world_size=rt.world_size, time_s=time.time())
        log.write(json.dumps(fields) + "\n")

    torch.manual_seed(0)
    model = ddpkit.wrap_model(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8)), rt)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train = ddpkit.build_train_loader(data, rt, batch_size=BATCH, seed=0)
    state = {"model": model, "optimizer": opt, "loader": train}
    ckpt = ddpkit.CheckpointManager(
        os.path.join(OUT, "checkpoints"), rt, state=state, every_steps=EVERY_STEPS
    )
    step = ckpt.resume()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    note("start", step=step, restart=restart, process_start_s=process_start_s())
    for epoch in range(train.epoch, EPOCHS):
        for xb, yb, index in train:
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
            step += 1
            note("step", epoch=epoch, step=step, samples=index.tolist())
            if ckpt.maybe_save(step) is not None:
                note("saved", step=step)
            held = os.path.exists(os.path.join(OUT, "hold"))
            time.sleep((STEP_S if rt.world_size >= 3 else SHRUNK_STEP_S) * (4 if held else 1))
    note("done", step=step)
    print(f"rank {rt.rank} of {rt.world_size} done at step {step}", flush=True)
