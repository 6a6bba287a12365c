"""Local SGD two ways against the no-sync ceiling: torch's ``post_localSGD_hook`` against DDP's
``no_sync()`` held open for the whole run (what ``ddpkit.enable_local_sgd`` does), interleaved.

    python bench/local_sgd_paths.py --rounds 7 --steps 150 --period 4

The MNIST CNN step loop of ``ddpkit bench overhead`` (batch 64 per rank, 2 processes, Adam,
random MNIST-shaped data, 10 warm-up steps, fresh processes per run, the order rotated each
round). Forms: ``no_sync`` (the raw loop inside ``model.no_sync()``: the ceiling), ``hook``
(``post_localSGD_hook`` with ``start_localSGD_iter=0``, ``post_local_gradient_allreduce=False``,
and ddpkit's averager in ``PostLocalSGDOptimizer``), ``flag`` (``model.no_sync()`` entered once
and held, the same optimizer). ``hook`` and ``flag`` compute the same parameters; only the work DDP
does per step differs. Prints per form the median samples/s and the median of the per-round
ratios to ``no_sync``.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist
from torch.nn import functional as F

from ddpkit.bench.steploop import StepLoopSettings, _dataset, timed_steps
from ddpkit.launch.spawn import run_distributed

FORMS = ("no_sync", "hook", "flag")


def _worker(store: dist.Store, form: str, settings: StepLoopSettings, period: int) -> float:
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook
    from torch.distributed.optim import PostLocalSGDOptimizer
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    from ddpkit.app.mnist.model import MnistCNN
    from ddpkit.parallel.comm import CommStats
    from ddpkit.parallel.local_sgd import PeriodicAverager

    torch.set_num_threads(settings.num_threads)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        torch.manual_seed(settings.seed)
        model = DistributedDataParallel(MnistCNN())
        optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
        if form == "hook":
            state = post_localSGD_hook.PostLocalSGDState(
                None, None, start_localSGD_iter=0, post_local_gradient_allreduce=False
            )
            model.register_comm_hook(state, post_localSGD_hook.post_localSGD_hook)
        averager = PeriodicAverager(period, None, CommStats())
        if form == "flag":
            averager.sync_off.enter_context(model.no_sync())
        if form != "no_sync":
            optimizer = PostLocalSGDOptimizer(optimizer, averager)
        data = _dataset(settings, world_size)
        sampler = DistributedSampler(data, world_size, rank, shuffle=True, seed=settings.seed)
        loader = DataLoader(data, batch_size=settings.batch_size, sampler=sampler)

        def step(batch) -> None:
            inputs, targets = batch
            optimizer.zero_grad(set_to_none=True)
            if form == "no_sync":
                with model.no_sync():
                    F.cross_entropy(model(inputs), targets).backward()
            else:
                F.cross_entropy(model(inputs), targets).backward()
            optimizer.step()

        return timed_steps(iter(loader), step, settings)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--period", type=int, default=4, help="H, steps between averaging")
    args = parser.parse_args()
    settings = StepLoopSettings(num_steps=args.steps, timeout_s=600)
    rates: dict[str, list[float]] = {form: [] for form in FORMS}
    for index in range(args.rounds):
        shift = index % len(FORMS)
        for form in FORMS[shift:] + FORMS[:shift]:
            seconds = run_distributed(
                _worker, 2, args=(form, settings, args.period), timeout_s=600, init=False
            )
            rates[form].append(2 * settings.batch_size * settings.num_steps / max(seconds))
            print(f"round {index + 1}/{args.rounds}: {form} {rates[form][-1]:.1f} samples/s")
    for form in FORMS:
        pairs = zip(rates[form], rates["no_sync"], strict=True)
        ratios = [rate / ceiling for rate, ceiling in pairs]
        print(
            f"{form:8s} {statistics.median(rates[form]):8.1f} samples/s, x no-sync "
            f"{statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})"
        )


if __name__ == "__main__":
    main()
