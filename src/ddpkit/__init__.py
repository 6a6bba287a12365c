"""ddpkit: PyTorch distributed data-parallel training, correct by default.

The public API (everything else is internal)::

    import ddpkit
    with ddpkit.init_runtime() as rt:                       # rank, world size, device, groups
        ddpkit.configure_logging(rt.info)                   # info once, warnings with [rank r/N]
        model = ddpkit.wrap_model(Net(), rt)                # DDP when world_size > 1
        loader = ddpkit.build_train_loader(train_set, rt, batch_size=64, seed=0)
        for epoch in range(3):
            for x, y in loader:                             # the sampler epoch advances itself
                ...
        test_loader = ddpkit.build_eval_loader(test_set, rt, batch_size=1000)
        metrics = ddpkit.evaluate(model, test_loader, rt)   # every test sample counted once
        # or the step spelled out: step = ddpkit.TrainStep(model, optimizer, runtime=rt)
        # and `for result in ddpkit.train_epoch(step, loader): ...` (one result per step);
        # step-time split: TrainStep(..., timer=ddpkit.StepTimer(rt)), then
        # timer.epoch_summary(rt) on every rank (one collective per epoch)

Launch with ``ddpkit run -n 2 train.py`` or ``torchrun --nproc-per-node 2 train.py``.
Every name in ``__all__`` has an entry in docs/api.md (tests/unit/test_public_api.py checks it);
arguments past the first two of every public callable are keyword-only.

``import ddpkit`` imports neither torch nor the API: each name is imported on first use
(PEP 562), so the ``ddpkit`` command answers ``--help`` and flag errors without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ddpkit.errors import ConfigError, DataError, DdpkitError, DistributedError

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time, __getattr__ below
    from ddpkit.checkpoint.manager import CheckpointManager
    from ddpkit.checkpoint.state import load_model_state
    from ddpkit.data.resize import fit_global_batch
    from ddpkit.data.sampler import (
        ShardedLoader,
        UnpaddedDistributedSampler,
        build_eval_loader,
        build_train_loader,
    )
    from ddpkit.diagnostics.translate import explain
    from ddpkit.env import ProcessInfo, detect_process_info
    from ddpkit.guards.grad_sync import GradSyncCheck, GradSyncError
    from ddpkit.guards.nonfinite import NonFiniteError, NonFiniteGuard
    from ddpkit.guards.replicas import ReplicaDivergenceError, check_replicas
    from ddpkit.guards.wrapped import WrappedModelError
    from ddpkit.log import configure_logging, get_logger
    from ddpkit.monitoring.observe import StepTimer, peak_memory_mb
    from ddpkit.monitoring.stragglers import StragglerDetector
    from ddpkit.parallel.comm import CommStats
    from ddpkit.parallel.local_sgd import enable_local_sgd
    from ddpkit.parallel.strategy import (
        DDP,
        FSDP,
        Auto,
        DataParallel,
        Live,
        Single,
        Strategy,
        ZeRO1,
        wrapped_strategy,
    )
    from ddpkit.parallel.syncbn import convert_sync_batchnorm
    from ddpkit.parallel.wrap import model_state_dict, wrap_model
    from ddpkit.parallel.zero import build_zero_optimizer
    from ddpkit.runtime.collectives import (
        all_gather,
        all_gather_object,
        all_reduce,
        all_reduce_sum,
        barrier,
    )
    from ddpkit.runtime.process_group import Runtime, init_runtime, resolve_backend
    from ddpkit.runtime.stop import TrainingStopped
    from ddpkit.training.accumulation import GradientAccumulator
    from ddpkit.training.dynamic import UnusedParameterDiagnosis, UnusedParameterError
    from ddpkit.training.evaluate import evaluate
    from ddpkit.training.loop import train_epoch
    from ddpkit.training.precision import MixedPrecision
    from ddpkit.training.step import StepResult, TrainStep
    from ddpkit.training.uneven import UnevenInputsError, join_uneven_inputs, verify_even_batches
    from ddpkit.watchdog.monitor import DeadlockError, StallError
    from ddpkit.wrappers import unwrap_model

__version__ = "0.1.0"

__all__ = [
    "Auto",
    "CheckpointManager",
    "CommStats",
    "ConfigError",
    "DDP",
    "DataError",
    "DataParallel",
    "DdpkitError",
    "DeadlockError",
    "DistributedError",
    "FSDP",
    "GradSyncCheck",
    "GradSyncError",
    "GradientAccumulator",
    "Live",
    "MixedPrecision",
    "NonFiniteError",
    "NonFiniteGuard",
    "ProcessInfo",
    "ReplicaDivergenceError",
    "Runtime",
    "ShardedLoader",
    "Single",
    "StallError",
    "StepResult",
    "StepTimer",
    "StragglerDetector",
    "Strategy",
    "TrainStep",
    "TrainingStopped",
    "UnevenInputsError",
    "UnpaddedDistributedSampler",
    "UnusedParameterDiagnosis",
    "UnusedParameterError",
    "WrappedModelError",
    "ZeRO1",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "all_reduce_sum",
    "barrier",
    "build_eval_loader",
    "build_train_loader",
    "build_zero_optimizer",
    "check_replicas",
    "configure_logging",
    "convert_sync_batchnorm",
    "detect_process_info",
    "enable_local_sgd",
    "evaluate",
    "explain",
    "fit_global_batch",
    "get_logger",
    "init_runtime",
    "join_uneven_inputs",
    "load_model_state",
    "model_state_dict",
    "peak_memory_mb",
    "resolve_backend",
    "train_epoch",
    "unwrap_model",
    "verify_even_batches",
    "wrap_model",
    "wrapped_strategy",
]

# The module of every name in __all__, imported on first access (ddpkit.X or from ddpkit import X).
_API_MODULES = {
    "Auto": "ddpkit.parallel.strategy",
    "CheckpointManager": "ddpkit.checkpoint.manager",
    "CommStats": "ddpkit.parallel.comm",
    "ConfigError": "ddpkit.errors",
    "DDP": "ddpkit.parallel.strategy",
    "DataError": "ddpkit.errors",
    "DataParallel": "ddpkit.parallel.strategy",
    "DdpkitError": "ddpkit.errors",
    "DeadlockError": "ddpkit.watchdog.monitor",
    "DistributedError": "ddpkit.errors",
    "FSDP": "ddpkit.parallel.strategy",
    "GradSyncCheck": "ddpkit.guards.grad_sync",
    "GradSyncError": "ddpkit.guards.grad_sync",
    "GradientAccumulator": "ddpkit.training.accumulation",
    "Live": "ddpkit.parallel.strategy",
    "MixedPrecision": "ddpkit.training.precision",
    "NonFiniteError": "ddpkit.guards.nonfinite",
    "NonFiniteGuard": "ddpkit.guards.nonfinite",
    "ProcessInfo": "ddpkit.env",
    "ReplicaDivergenceError": "ddpkit.guards.replicas",
    "Runtime": "ddpkit.runtime.process_group",
    "ShardedLoader": "ddpkit.data.sampler",
    "Single": "ddpkit.parallel.strategy",
    "StallError": "ddpkit.watchdog.monitor",
    "StepResult": "ddpkit.training.step",
    "StepTimer": "ddpkit.monitoring.observe",
    "StragglerDetector": "ddpkit.monitoring.stragglers",
    "Strategy": "ddpkit.parallel.strategy",
    "TrainStep": "ddpkit.training.step",
    "TrainingStopped": "ddpkit.runtime.stop",
    "UnevenInputsError": "ddpkit.training.uneven",
    "UnpaddedDistributedSampler": "ddpkit.data.sampler",
    "UnusedParameterDiagnosis": "ddpkit.training.dynamic",
    "UnusedParameterError": "ddpkit.training.dynamic",
    "WrappedModelError": "ddpkit.guards.wrapped",
    "ZeRO1": "ddpkit.parallel.strategy",
    "all_gather": "ddpkit.runtime.collectives",
    "all_gather_object": "ddpkit.runtime.collectives",
    "all_reduce": "ddpkit.runtime.collectives",
    "all_reduce_sum": "ddpkit.runtime.collectives",
    "barrier": "ddpkit.runtime.collectives",
    "build_eval_loader": "ddpkit.data.sampler",
    "build_train_loader": "ddpkit.data.sampler",
    "build_zero_optimizer": "ddpkit.parallel.zero",
    "check_replicas": "ddpkit.guards.replicas",
    "configure_logging": "ddpkit.log",
    "convert_sync_batchnorm": "ddpkit.parallel.syncbn",
    "detect_process_info": "ddpkit.env",
    "enable_local_sgd": "ddpkit.parallel.local_sgd",
    "evaluate": "ddpkit.training.evaluate",
    "explain": "ddpkit.diagnostics.translate",
    "fit_global_batch": "ddpkit.data.resize",
    "get_logger": "ddpkit.log",
    "init_runtime": "ddpkit.runtime.process_group",
    "join_uneven_inputs": "ddpkit.training.uneven",
    "load_model_state": "ddpkit.checkpoint.state",
    "model_state_dict": "ddpkit.parallel.wrap",
    "peak_memory_mb": "ddpkit.monitoring.observe",
    "resolve_backend": "ddpkit.runtime.process_group",
    "train_epoch": "ddpkit.training.loop",
    "unwrap_model": "ddpkit.wrappers",
    "verify_even_batches": "ddpkit.training.uneven",
    "wrap_model": "ddpkit.parallel.wrap",
    "wrapped_strategy": "ddpkit.parallel.strategy",
}


def __getattr__(name: str) -> Any:
    """``ddpkit.X``: import X's module on first use and keep X here."""
    module = _API_MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
