"""Inside each rank of ``ddpkit bench memory``: one strategy's step loop on a wide MLP, with
per-rank bytes of parameters, gradients and optimizer state read from the tensors themselves.

What one run does (every strategy the same work): ``init_runtime`` (gloo/nccl, watchdog on, as
``ddpkit train``), an MLP of ``depth`` ``Linear(width, width)`` + ReLU blocks from the same seed,
``wrap_model(strategy=...)`` (``single`` at one process), AdamW (``build_zero_optimizer`` for
``zero1``), :class:`~ddpkit.TrainStep` on random batches of ``batch_size`` per rank, ``W``
warm-up steps, then:

- the bytes: ``numel * element_size`` of this rank's part of every parameter (FSDP: its
  ``DTensor`` shard), of every gradient (kept by the last step), of every optimizer state tensor
  (ZeRO: the rank's local optimizer only);
- the collective payload of one step, counted by wrapping torch.distributed's Python entry
  points for that step only: ``all_gather_single`` (output bytes), ``reduce_scatter_single``
  (input bytes), ``broadcast`` and ``all_reduce`` (tensor bytes). DDP's gradient all-reduce runs
  in C++ and is counted as the gradient bytes its buckets carry (every trainable parameter's);
- ``K`` timed steps between two barriers; the peak RSS of the process (``ru_maxrss``: the
  high-water mark since the process started, model construction included) and its RSS at the
  end (``VmRSS``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

STRATEGIES = ("ddp", "zero1", "fsdp")
COUNTED = {  # torch.distributed function -> (position, keyword) of the tensor whose bytes count
    "all_gather_single": (0, "output_tensor"),  # the gathered (unsharded) tensor
    "reduce_scatter_single": (1, "input"),  # the unsharded tensor reduced
    "broadcast": (0, "tensor"),
    "all_reduce": (0, "tensor"),
}


@dataclass(frozen=True)
class MemorySettings:
    """One run of ``ddpkit bench memory``.

    Attributes:
        width: features of every ``Linear`` layer.
        depth: ``Linear(width, width)`` layers (parameters: ``depth * (width**2 + width)``).
        batch_size: samples per rank per step.
        num_steps: timed optimizer steps (K); num_warmup_steps: steps before them (W).
        num_threads: torch threads per process.
        timeout_s: one run is killed (every rank) after this.
        return_freed_memory: serve allocations of 1 MiB and more with their own ``mmap``, so
            RSS shows what is held (see :func:`_return_freed_memory`); slower allocations, so
            the memory runs are not the timed ones.
    """

    width: int = 2048
    depth: int = 12
    batch_size: int = 8
    num_steps: int = 3
    num_warmup_steps: int = 1
    num_threads: int = 1
    timeout_s: float = 600.0
    return_freed_memory: bool = False

    @property
    def num_parameters(self) -> int:
        return self.depth * (self.width * self.width + self.width)


def build_mlp(settings: MemorySettings) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(settings.depth):
        layers += [nn.Linear(settings.width, settings.width), nn.ReLU()]
    return nn.Sequential(*layers)


def _local_bytes(tensors: Any) -> int:
    from ddpkit.wrappers import local_tensor

    return sum(local_tensor(t).numel() * t.element_size() for t in tensors)


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state (its shards only)."""
    from ddpkit.parallel.zero import is_zero_optimizer

    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    states = optimizer.state
    if is_zero_optimizer(optimizer):  # a ZeroRedundancyOptimizer: its local optimizer's state
        states = cast("ZeroRedundancyOptimizer", optimizer).optim.state
    tensors = [v for s in states.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "param_bytes": _local_bytes(params),
        "grad_bytes": _local_bytes(grads),
        "optimizer_bytes": _local_bytes(tensors),
    }


@contextlib.contextmanager
def counting_collectives(counts: dict[str, int]) -> Iterator[None]:
    """Inside: the payload bytes of torch.distributed's Python collectives, added to ``counts``
    by function name (see :data:`COUNTED`); the originals are put back on exit."""
    originals = {name: getattr(dist, name) for name in COUNTED}

    def counting(name: str):
        position, keyword = COUNTED[name]

        def call(*args: Any, **kwargs: Any) -> Any:
            tensor = args[position] if len(args) > position else kwargs[keyword]
            counts[name] = counts.get(name, 0) + tensor.numel() * tensor.element_size()
            return originals[name](*args, **kwargs)

        return call

    try:
        for name in originals:
            setattr(dist, name, counting(name))
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _optimizer(model: nn.Module, runtime: Any) -> torch.optim.Optimizer:
    from ddpkit.parallel.strategy import ZeRO1, wrapped_strategy
    from ddpkit.parallel.zero import build_zero_optimizer

    if isinstance(wrapped_strategy(model), ZeRO1):
        return build_zero_optimizer(
            model.parameters(), runtime, optimizer_class=torch.optim.AdamW, lr=1e-4
        )
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


def _batches(settings: MemorySettings, rank: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(rank)
    while True:
        x = torch.randn(settings.batch_size, settings.width, generator=gen)
        yield x, torch.randint(0, settings.width, (settings.batch_size,), generator=gen)


def memory_worker(store: dist.Store, strategy: str, settings: MemorySettings) -> dict:
    """One rank of one run (module level, so the harness can start it)."""
    from ddpkit.parallel.wrap import wrap_model
    from ddpkit.runtime.process_group import init_runtime
    from ddpkit.training.step import TrainStep

    os.environ["OMP_NUM_THREADS"] = str(settings.num_threads)
    torch.set_num_threads(settings.num_threads)
    if settings.return_freed_memory:
        _return_freed_memory()
    with init_runtime("auto", store=store, stall_timeout_s=300.0) as runtime:
        rss_start_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        wrapped = strategy if runtime.world_size > 1 else "single"
        model = wrap_model(build_mlp(settings), runtime, strategy=wrapped)
        optimizer = _optimizer(model, runtime)
        step = TrainStep(model, optimizer, runtime=runtime, same_batch_sizes=True)
        windows = step.windows(_batches(settings, runtime.rank))
        for _ in range(settings.num_warmup_steps):
            step(next(windows))
        counts: dict[str, int] = {}
        with counting_collectives(counts):
            step(next(windows))
        if wrapped in ("ddp", "zero1"):  # DDP's C++ reducer all-reduces every gradient
            counts["ddp_all_reduce"] = sum(
                p.numel() * p.element_size() for p in model.parameters() if p.requires_grad
            )
        seconds = _timed(runtime, step, windows, settings.num_steps)
        result = {
            **state_bytes(model, optimizer),
            "comm_bytes_per_step": counts,
            "seconds": seconds,
            "rss_start_mib": rss_start_mib,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_end_mib": _rss_now_mib(),
        }
        del windows, step, optimizer, model  # freed while their process group still exists
        gc.collect()
        return result


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def _return_freed_memory() -> None:
    """Make glibc serve every allocation of 1 MiB or more with its own ``mmap`` (given back to
    the system on ``free``), with the same fixed threshold in every run.

    glibc's default threshold grows to the largest block freed (up to 32 MiB on 64-bit), after
    which blocks of that size come from the heap and stay resident when freed; RSS then shows
    what was ever allocated (the full model before FSDP shards it, the gathered parameters)
    rather than what is held. Without glibc (another libc) nothing changes.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(name).mallopt(M_MMAP_THRESHOLD, 1 << 20)


def _rss_now_mib() -> float:
    """This process's resident set now (``VmRSS`` of ``/proc/self/status``), in MiB."""
    with open("/proc/self/status") as status:
        line = next(x for x in status if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def _timed(runtime: Any, step: Any, windows: Iterator[Any], num_steps: int) -> float:
    """``num_steps`` steps between two barriers: this rank's seconds. Collective."""
    group = runtime.process_group
    if group is not None:
        dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(num_steps):
        step(next(windows))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if group is not None:
        dist.barrier(group=group)
    return seconds
