"""``torch.compile`` for a wrapped model: in the order torch recommends, and in place.

What :func:`ddpkit.wrap_model` does with ``compile=True`` (or a dict of ``torch.compile``
keyword arguments), per strategy:

- ``ddp``: DDP first, then the DDP wrapper compiled, the order of torch's DDP notes
  (``ddp_model = DDP(model); ddp_model = torch.compile(ddp_model)``): dynamo then sees DDP's
  buckets and its DDPOptimizer splits the graph at their boundaries, so each bucket's all-reduce
  still overlaps the backward of the rest. ddpkit compiles with ``nn.Module.compile()``, which
  is that same ``torch.compile`` of the wrapper's call (measured with ``aot_eager``: the same
  graphs and split, bitwise the same parameters after the same steps), applied in place: the
  model stays a ``DistributedDataParallel`` (no ``OptimizedModule``), so ``model.module``,
  ``no_sync()``, comm hooks, local SGD and ddpkit's guards see what they know, and
  ``model.state_dict()`` never gains ``_orig_mod.`` keys (checkpoints of compiled and eager
  runs are interchangeable).
- ``single`` (one process): the module compiled in place.
- ``fsdp`` (FSDP2, built by ``fully_shard``): each sharded block (every ``FSDPModule`` below the
  root, else the root) compiled in place, torchtitan's per-block form: one graph per block,
  reused across identical blocks, and FSDP's per-block all-gather/reduce-scatter stay where
  they are. See :func:`compile_wrapped`.
- ``dp``: refused (``DataParallel`` replicates the module on every forward).

Two traps are caught up front: a ``bucket_cap_mb`` below DDPOptimizer's first bucket (torch
asserts "First bucket should be smaller/equal to other buckets" at the first forward), and a
DDP model whose top module is one of torch's own (``nn.Sequential``): dynamo skips the frames of
``torch.nn`` that DDP's eager forward calls, so nothing would be compiled (a warning says so).

Under compile, gradients that a bug kept from being all-reduced would make the replicas drift
apart silently, so the first optimizer steps are checked (see :mod:`ddpkit.guards.grad_sync`).
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

import torch
from torch import nn

from ddpkit.errors import ConfigError
from ddpkit.guards.grad_sync import attach_grad_sync_check
from ddpkit.log import get_logger
from ddpkit.parallel.choices import DEFAULT_CHECK_STEPS
from ddpkit.parallel.rules import compile_with_small_buckets, compile_with_strategy
from ddpkit.parallel.strategy import DDP, FSDP, Live, Single, Strategy
from ddpkit.runtime.process_group import Runtime

_ONE_MIB = 1024 * 1024


@functools.cache
def _compile_keywords() -> frozenset[str]:
    """torch.compile's keywords wrap_model passes on (the module is wrap_model's own argument)."""
    return frozenset(inspect.signature(torch.compile).parameters) - {"model"}


def compile_options(compile: bool | dict[str, Any] | None) -> dict[str, Any] | None:
    """``torch.compile`` keyword arguments from ``wrap_model``'s ``compile`` (``None``: off).

    Raises:
        ConfigError: not a bool or dict; a key ``torch.compile`` does not take.
    """
    if compile is None or compile is False:
        return None
    if compile is True:
        return {}
    if not isinstance(compile, dict):
        raise ConfigError(
            f"invalid compile: compile={compile!r}. Use True, False or a dict of torch.compile "
            "keyword arguments, e.g. compile={'mode': 'max-autotune'}."
        )
    unknown = sorted(set(compile) - _compile_keywords())
    if unknown:
        raise ConfigError(
            f"unknown torch.compile option for wrap_model: {', '.join(unknown)}. torch.compile "
            f"takes {', '.join(sorted(_compile_keywords()))}. Fix the name or drop it."
        )
    return dict(compile)


def prepare_compile(
    strategy: Strategy,
    compile: bool | dict[str, Any] | None,
    grad_sync_check_steps: int | None,
) -> tuple[dict[str, Any] | None, int]:
    """Check ``wrap_model``'s compile arguments for the resolved ``strategy``.

    Returns:
        ``(torch.compile keyword arguments or None for off, optimizer steps to check)``; the
        steps default to :data:`~ddpkit.parallel.choices.DEFAULT_CHECK_STEPS` under compile
        with DDP, else 0.

    Raises:
        ConfigError: a bad ``compile`` value or key; ``dp`` with compile; ``bucket_cap_mb``
            below DDPOptimizer's first bucket; ``grad_sync_check_steps`` negative, or given for
            a strategy whose gradients DDP does not all-reduce (``dp``, ``fsdp``; ``live``
            ignores it).
    """
    options = compile_options(compile)
    # live: TrainStep all-reduces the gradients itself; the check is ignored there, as it always
    # was (a live job cannot switch to ddp to follow advice about it)
    steps = 0 if isinstance(strategy, Live) else grad_sync_check_steps
    if steps is None:
        steps = DEFAULT_CHECK_STEPS if options is not None and strategy.ddp_gradients else 0
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ConfigError(
            f"invalid grad_sync_check_steps={steps!r}. It counts optimizer steps: an integer "
            ">= 0 (0 = off). Fix the value."
        )
    problem = compile_with_strategy(strategy.name) if options is not None else None
    if problem:
        raise ConfigError(f"{problem}.")
    # single: nothing to compare at world size 1 (the check is a no-op there)
    if steps and not strategy.ddp_gradients and not isinstance(strategy, Single):
        raise ConfigError(
            f"grad_sync_check_steps={steps} with strategy={strategy.name!r}: the check compares "
            "DDP's all-reduced gradients across ranks, which this strategy does not have. Drop "
            "it (0), or use strategy='ddp'."
        )
    cap_mb = strategy.bucket_cap_mb if isinstance(strategy, DDP) else None
    first_mb = getattr(torch.distributed, "_DEFAULT_FIRST_BUCKET_BYTES", _ONE_MIB) / _ONE_MIB
    problem = compile_with_small_buckets(cap_mb, first_mb) if options is not None else None
    if problem:
        raise ConfigError(f"{problem}.")
    return options, steps


def finish_compile(
    model: nn.Module,
    runtime: Runtime,
    strategy: Strategy,
    options: dict[str, Any] | None,
    check_steps: int,
) -> nn.Module:
    """Compile the wrapped ``model`` (when ``options`` is not None) and attach the gradient
    sync check (``check_steps`` > 0, DDP, 2+ ranks); returns ``model`` itself."""
    if options is not None:
        compile_wrapped(model, strategy, options)
        _quiet_ddp_profiler_warning()
    check = None
    if strategy.ddp_gradients:
        context = "under torch.compile" if options is not None else ""
        check = attach_grad_sync_check(model, runtime, check_steps, context=context)
    if options is not None:
        get_logger("parallel").info(
            "wrap_model: %s compiled in place with torch.compile(%s); the first forward compiles%s",
            type(model).__name__,
            ", ".join(f"{k}={v!r}" for k, v in options.items()),
            f"; gradients compared across ranks before the first {check_steps} optimizer steps"
            if check is not None
            else "",
        )
    return model


def compile_wrapped(model: nn.Module, strategy: Strategy, options: dict[str, Any]) -> nn.Module:
    """Compile the wrapped ``model`` in place, in the order torch recommends for ``strategy``.

    Returns ``model`` itself (same object, same class, same state dict keys). Compilation is
    lazy: the first forward compiles (seconds to a minute; see docs/performance.md).
    Not a collective.

    Args:
        model: what :func:`ddpkit.wrap_model` built: the ``DistributedDataParallel`` wrapper
            (``ddp``, ``zero1``), the module (``single``), or the ``fully_shard``-ed root
            (``fsdp``).
        strategy: the resolved strategy.
        options: ``torch.compile`` keyword arguments (``{}``: torch's defaults, inductor).
    """
    if isinstance(strategy, FSDP):
        for block in _fsdp_blocks(model):
            block.compile(**options)
    else:
        model.compile(**options)
    inner = getattr(model, "module", model) if strategy.ddp_gradients else None
    if inner is not None and type(inner).forward.__module__.startswith("torch."):
        get_logger("parallel").warning(
            "wrap_model(compile=...): the model is torch's own %s, whose forward dynamo skips "
            "under DDP, so nothing would be compiled. Put it inside a module of your own (class "
            "Net(nn.Module) with a forward) and wrap that.",
            type(inner).__name__,
        )
    return model


def _drop_profiler_warning(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Profiler record function")


def _quiet_ddp_profiler_warning() -> None:
    """Drop dynamo's "Profiler record function ... will be ignored" warning (one per rank):
    it is about DDP's own ``record_function("DistributedDataParallel.forward")``, which
    compiled code skips, and says nothing about the user's model."""
    logger = logging.getLogger("torch._dynamo.variables.ctx_manager")
    if _drop_profiler_warning not in logger.filters:
        logger.addFilter(_drop_profiler_warning)


def _fsdp_blocks(model: nn.Module) -> list[nn.Module]:
    """The outermost modules ``fully_shard`` was applied to below the root (else the root)."""
    try:
        from torch.distributed.fsdp import FSDPModule  # torch >= 2.6
    except ImportError:  # pragma: no cover - older torch keeps it in _composable
        from torch.distributed._composable.fsdp import FSDPModule
    sharded = [name for name, m in model.named_modules() if name and isinstance(m, FSDPModule)]
    outermost = [n for n in sharded if not any(n.startswith(o + ".") for o in sharded)]
    return [model.get_submodule(name) for name in outermost] or [model]
