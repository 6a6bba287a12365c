"""A user's own loop with live fault tolerance, as docs/fault-tolerance.md shows it.

    ddpkit run -n 3 --fault-tolerance live tests/live/scripts/live_loop.py OUT_DIR

Each worker writes ``OUT_DIR/pid-<pid>`` (its slot) at start and, every step on rank 0,
``OUT_DIR/progress`` (the step); at the end one ``FINAL {json}`` line per worker: its pid, rank,
world size, step, the parameters' and optimizer state's checksums, the learning rate. With
``SLOW_HEAL_S`` the state sent to a replacement takes that long to produce, after writing
``OUT_DIR/healing`` (so a test can kill a replacement while it heals). ``STEP_S``: a sleep in
every backward (so a SIGKILL at a random moment lands in backward). ``LOG_STEPS=1``: every
worker appends to ``OUT_DIR/steps-<pid>.txt`` the samples of each forward (``F step quorum
indices``, written before the step's collectives, so a worker killed after its vote still left
them) and each committed step's parameter checksum (``C step quorum digest``);
bench/live_trials.py checks replicas and sample accounting with them.
A file ``OUT_DIR/hang-<slot>`` makes that slot's worker hang in its own code (a sleep between
steps, its heartbeat alive); ``TRAIN_TIMEOUT``: ``init_runtime``'s ``train_timeout_s``.
"""

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

OUT = Path(sys.argv[1])
EPOCHS = int(os.environ.get("EPOCHS", "6"))
STEP_S = float(os.environ.get("STEP_S", "0.02"))
SLOW_HEAL_S = float(os.environ.get("SLOW_HEAL_S", "0"))


class SlowBackward(torch.autograd.Function):
    """Identity forward; its backward sleeps STEP_S (the step's compute, stretched)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(STEP_S)
        return grad


class Net(nn.Module):
    """The input's last column is the sample's index (recorded, not learned from)."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 64)
        self.body = nn.Sequential(nn.ReLU(), nn.Linear(64, 8))
        self.key_fn = lambda: "0 0"  # "step quorum" of the step in progress (set by the loop)
        self.key = ""

    def forward(self, x):
        if LOG is not None and torch.is_grad_enabled():
            self.key = self.key_fn()
            with LOG.open("a") as handle:
                handle.write(f"F {self.key} {x[:, -1].long().tolist()}\n")
        # the sleep on an activation that needs a gradient (on the input, which needs none,
        # autograd would never call the backward)
        return self.body(SlowBackward.apply(self.first(x[:, :-1])))


class HealProbe:
    """State of our own: sending it to a replacement is slow with SLOW_HEAL_S."""

    def state_dict(self):
        if SLOW_HEAL_S:
            (OUT / "healing").write_text(str(os.getpid()))
            time.sleep(SLOW_HEAL_S)
        return {}

    def load_state_dict(self, state):
        pass


x = torch.randn(3072, 8, generator=torch.Generator().manual_seed(0))
y = x.argmax(dim=1)
x = torch.cat([x, torch.arange(len(x), dtype=x.dtype)[:, None]], dim=1)
LOG = OUT / f"steps-{os.getpid()}.txt" if os.environ.get("LOG_STEPS") == "1" else None
train_set, test_set = TensorDataset(x[:2560], y[:2560]), TensorDataset(x[2560:], y[2560:])
(OUT / f"pid-{os.getpid()}").write_text(os.environ.get("DDPKIT_LIVE_SLOT", "-1"))

SLOT = os.environ.get("DDPKIT_LIVE_SLOT", "-1")
with ddpkit.init_runtime(train_timeout_s=float(os.environ.get("TRAIN_TIMEOUT", "1800"))) as rt:
    ddpkit.configure_logging(rt.info)
    torch.manual_seed(0)
    model = ddpkit.wrap_model(Net(), rt)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.5)
    train = ddpkit.build_train_loader(train_set, rt, batch_size=32, seed=0)
    test = ddpkit.build_eval_loader(test_set, rt, batch_size=256)
    state = {
        "model": model,
        "optimizer": opt,
        "scheduler": scheduler,
        "loader": train,
        "probe": HealProbe(),
    }
    every = int(os.environ.get("CKPT_EVERY", "25"))
    ckpt = ddpkit.CheckpointManager(OUT / "checkpoints", rt, state=state, every_steps=every)
    step = ckpt.resume()  # a replacement: healed from a live peer here
    train_step = ddpkit.TrainStep(model, opt, runtime=rt, start_step=step)
    net = ddpkit.unwrap_model(model)

    net.key_fn = lambda: (
        f"{train_step.num_steps + 1} {rt.live.quorum.number if rt.live and rt.live.quorum else 0}"
    )
    for epoch in range(train.epoch, EPOCHS):
        for result in ddpkit.train_epoch(train_step, train):
            committed_key = net.key  # the key of this step's forward
            scheduler.step()
            if LOG is not None:
                digest = hashlib.sha256(
                    torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
                ).hexdigest()[:16]
                with LOG.open("a") as handle:
                    handle.write(f"C {committed_key} {digest} {epoch}\n")
            if rt.is_rank_zero:
                (OUT / "progress.tmp").write_text(str(result.step))
                os.replace(OUT / "progress.tmp", OUT / "progress")  # never read half-written
            if (OUT / f"hang-{SLOT}").exists():
                time.sleep(3600)  # hung in the script's own code
            ckpt.maybe_save(result.step)
        metrics = ddpkit.evaluate(model, test, rt)
        ddpkit.get_logger("train").info(
            "epoch %d step %d world %d accuracy %.4f",
            epoch,
            train_step.num_steps,
            rt.world_size,
            metrics["accuracy"],
        )
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    momenta = [s["momentum_buffer"] for s in opt.state.values() if "momentum_buffer" in s]
    final = {
        "pid": os.getpid(),
        "rank": rt.rank,
        "world_size": rt.world_size,
        "step": train_step.num_steps,
        "params": params.double().sum().item(),
        "params_sha256": hashlib.sha256(params.numpy().tobytes()).hexdigest(),
        "momentum": sum(m.double().sum().item() for m in momenta),
        "lr": scheduler.get_last_lr()[0],
        "counters": vars(rt.live.counters) if rt.live else {},
    }
    print("FINAL " + json.dumps(final), flush=True)
