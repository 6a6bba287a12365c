"""The training loop of one epoch: accumulation windows, mixed precision, guards, uneven inputs.

Used by ``ddpkit train`` (:mod:`ddpkit.app.mnist.job`) and usable with any classifier-style
model whose loader yields ``(inputs, targets)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from ddpkit.distributed.collectives import all_reduce_sum
from ddpkit.distributed.process_group import Runtime
from ddpkit.distributed.sampler import ShardedLoader
from ddpkit.training.accumulation import AccumulationWindow, GradientAccumulator
from ddpkit.training.observe import StepTimer
from ddpkit.training.uneven import join_uneven_inputs, verify_even_batches


def train_one_epoch(
    model: nn.Module,
    loader: ShardedLoader,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    runtime: Runtime,
    on_step: Callable[[], None] | None = None,
    may_step: Callable[[torch.Tensor], bool] | None = None,
    accumulator: GradientAccumulator | None = None,
    clip_grad_norm: float = 0.0,
    join: bool = False,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
    timer: StepTimer | None = None,
) -> tuple[float, float, float]:
    """One pass over this rank's shard (capped by the loader's ``max_batches``).

    Each optimizer step takes one window of the ``accumulator`` (default: K = 1, fp32), whose
    micro-steps run forward and backward under ``no_sync`` except the last. ``may_step(loss)``
    runs after the last backward (``loss``: the window's summed micro-batch losses) and decides
    whether the optimizer steps (the non-finite guard); ``on_step`` runs after every optimizer
    step, taken or skipped. After a resume the pass starts where the checkpoint left it, and
    only those batches are counted. Without ``join`` the ranks first check they have the same
    number of batches (one all-reduce), so uneven loaders fail at once instead of hanging.

    ``loss_fn(outputs, targets)`` gives a micro-batch's mean loss (default: cross-entropy).
    ``timer`` (a :class:`~ddpkit.StepTimer`) times each step's data wait, forward,
    backward (with DDP's overlapped all-reduce) and optimizer phases, forward and backward
    summed over the micro-steps, and counts steps and samples before each ``on_step``; it
    never changes what is computed. Read it with ``timer.epoch_summary(runtime)``.

    Collective: call on every rank (DDP's backward and the final all-reduce).

    Returns:
        ``(mean train loss over all ranks' samples, global samples, seconds)``.
    """
    model.train()
    start = time.perf_counter()
    accumulator = accumulator or GradientAccumulator(model, runtime)
    if not join and loader.full_pass_batches() is not None:  # else a stream: even by design
        verify_even_batches(len(loader) - loader.state_dict()["batches_done"], runtime)
    loss_sum = num_samples = 0.0
    timer = timer or StepTimer(runtime, enabled=False)
    with join_uneven_inputs(model, runtime, enable=join):
        windows = accumulator.windows(loader)
        while True:
            with timer.phase("data_wait"):  # the window draws its K batches up front
                window = next(windows, None)
            if window is None:
                break
            with timer.phase("optimizer"):
                optimizer.zero_grad(set_to_none=True)
            window_loss, step_loss_sum, step_samples = _micro_steps(
                model, window, runtime, loss_fn, timer
            )
            for value in step_loss_sum:  # added one by one: the same float sum as before
                loss_sum += value
            num_samples += step_samples
            with timer.phase("optimizer"):
                if may_step is None or may_step(window_loss):
                    if accumulator.precision.step(
                        optimizer, model, max_norm=clip_grad_norm
                    ).stepped:
                        schedule.step()
            timer.end_step(
                window.num_samples, loss_sum=sum(step_loss_sum), num_samples=int(step_samples)
            )
            if on_step is not None:
                on_step()
    seconds = time.perf_counter() - start
    loss_sum, num_samples = all_reduce_sum([loss_sum, num_samples], runtime).tolist()
    return loss_sum / max(num_samples, 1.0), num_samples, seconds


def _micro_steps(
    model: nn.Module,
    window: AccumulationWindow,
    runtime: Runtime,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    timer: StepTimer,
) -> tuple[torch.Tensor, list[float], int]:
    """Forward and backward of a window's micro-steps (the last syncs gradients).

    Returns:
        ``(summed micro-batch mean losses, per-micro-step loss x samples, local samples)``.
    """
    window_loss = torch.zeros((), device=runtime.device)
    loss_sums: list[float] = []
    num_samples = 0
    for micro in window:
        with timer.phase("data_wait"):
            inputs, targets = (t.to(runtime.device) for t in micro.batch)
        with micro:  # no_sync() unless last; forward AND backward inside
            with timer.phase("forward"):
                loss = loss_fn(model(inputs), targets)
            with timer.phase("backward_comm"):  # includes DDP's overlapped all-reduce
                micro.backward(loss)
        window_loss += loss.detach().float()
        loss_sums.append(float(loss.detach()) * len(targets))
        num_samples += len(targets)
    return window_loss, loss_sums, num_samples
