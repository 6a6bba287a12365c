"""Wrap a model for a strategy, and unwrap it for saving and evaluation.

Strategies:
- ``single``: the model on this rank's device, no gradient sync (world size 1).
- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` over the runtime's training group; its
  gradient buckets all-reduce during backward (overlap), tuned by ``bucket_cap_mb``.
- ``dp``: ``torch.nn.DataParallel`` over 2+ CUDA devices in one process (see
  :mod:`ddpkit.parallel.dp`; PyTorch, and ddpkit, recommend ``ddp`` instead).
- ``zero1``: ``ddp`` for the model; the optimizer state is sharded by torch's
  ``ZeroRedundancyOptimizer`` (build it with :func:`ddpkit.build_zero_optimizer`; see
  :mod:`ddpkit.parallel.zero`).
- ``fsdp``: torch's FSDP2 ``fully_shard`` on each block and the root: parameters, gradients and
  optimizer state sharded (see :mod:`ddpkit.parallel.fsdp`).
- ``auto``: ``ddp`` when the world size is above 1, else ``single``.

Wrap-time options: ``sync_batchnorm`` (see :mod:`ddpkit.parallel.syncbn`), ``grad_compression``
and byte counting (see :mod:`ddpkit.parallel.comm`), ``compile`` (``torch.compile`` in place,
in torch's order, with the first steps' gradients checked: see :mod:`ddpkit.parallel.compile`);
for ``fsdp``: ``wrap_policy``, ``reshard_after_forward`` and ``precision``.
"""

from __future__ import annotations

import functools
import inspect
import sys
import weakref
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from ddpkit.errors import ConfigError, DistributedError
from ddpkit.guards.wrapped import WrapGuard, verify_same_parameters
from ddpkit.log import get_logger
from ddpkit.parallel.choices import STRATEGIES  # torch-free: the train flags read them
from ddpkit.parallel.comm import (
    CommStats,
    check_compression,
    powersgd_bucket_cap_mb,
    register_grad_hook,
)
from ddpkit.runtime.process_group import Runtime

_WRAPPERS = (DistributedDataParallel, DataParallel)
_FSDP_DEFAULTS = {"wrap_policy": None, "reshard_after_forward": True, "precision": "32"}
# the strategy each DDP wrapper was built for ("ddp" or "zero1"); weak: dropped models are freed
_STRATEGY_OF: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def is_compiled(model: object) -> bool:
    """True for what ``torch.compile(module)`` returns (``torch._dynamo``'s ``OptimizedModule``).

    Looked up only when ``torch._dynamo`` is already imported (a compiled module implies it is),
    so this costs no import; the compiled wrapper holds the original module in ``_orig_mod``,
    the attribute torch documents for it and every library unwraps through.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    return optimized is not None and isinstance(model, optimized)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside any DDP/DataParallel and ``torch.compile`` wrappers.

    Its state dict keys lack the wrappers' ``module.`` and ``_orig_mod.`` prefixes, in any
    nesting (``DDP(torch.compile(m))``, ``torch.compile(DDP(m))``). Not a collective.

    Example:
        >>> unwrap_model(torch.compile(DDP(net))) is net                     # doctest: +SKIP
        True
    """
    while True:
        if isinstance(model, _WRAPPERS):
            model = model.module
        elif is_compiled(model):
            model = model._orig_mod
        else:
            return model


def wrap_model(
    model: nn.Module,
    runtime: Runtime,
    *,
    strategy: str = "auto",
    sync_batchnorm: bool = False,
    grad_compression: str = "none",
    comm_stats: CommStats | None = None,
    powersgd_rank: int = 1,
    powersgd_start_step: int = 10,
    device_ids: list[int] | None = None,
    compile: bool | dict[str, Any] = False,
    grad_sync_check_steps: int | None = None,
    wrap_policy: Any = None,
    reshard_after_forward: bool = True,
    precision: str = "32",
    **ddp_kwargs: Any,
) -> nn.Module:
    """Move ``model`` to the rank's device and wrap it for ``strategy``.

    Collective (for ``ddp``): call on every rank; DDP broadcasts rank 0's parameters and buffers,
    so all replicas start identical.

    Guarded by default (``ddp``, see :mod:`ddpkit.guards.wrapped`): the ranks' trainable
    parameters are compared first, and from then on a parameter frozen, unfrozen or assigned
    after wrapping, or a backward that bypassed the wrapper's forward (``model.module(x)``),
    raises :class:`~ddpkit.guards.wrapped.WrappedModelError` at the next step. To change the
    model, wrap again: ``wrap_model(unwrap_model(model), runtime)``.

    At world size 1 (``auto`` -> ``single``) the module itself is returned, without a DDP
    wrapper: reach its own attributes through :func:`unwrap_model` (``unwrap_model(model).x``),
    which works at every world size, never ``model.x`` or ``model.module.x``. The DDP options
    (``sync_batchnorm``, ``grad_compression``, ``**ddp_kwargs``) do nothing there, said in the
    same info line, so one script runs unchanged as ``python train.py`` and under a launcher;
    their values are still checked (an unknown DDP keyword fails at every world size). An
    explicit ``strategy="single"`` or ``"dp"`` with them is refused instead.

    Args:
        model: an unwrapped ``nn.Module``.
        runtime: the job's :class:`Runtime`.
        strategy: ``auto``, ``single``, ``ddp``, ``dp``, ``zero1`` (DDP; pair it with
            :func:`ddpkit.build_zero_optimizer`) or ``fsdp`` (FSDP2 ``fully_shard``).
        sync_batchnorm: convert every BatchNorm layer to a synchronised one before wrapping
            (statistics over all ranks' samples; ``ddp`` only, no-op without BatchNorm).
        grad_compression: ``none``, ``fp16``, ``bf16`` or ``powersgd`` (``ddp`` only): the DDP
            comm hook that all-reduces gradients.
        comm_stats: a :class:`~ddpkit.parallel.comm.CommStats` to count the gradient bytes in.
            With ``none`` and no ``comm_stats``, no hook is registered (DDP's built-in
            all-reduce), so a hook can still be added later (e.g. local SGD).
        powersgd_rank: rank of PowerSGD's low-rank factors (``powersgd`` only).
        powersgd_start_step: backward passes with plain all-reduce before PowerSGD starts.
        device_ids: CUDA devices for ``dp`` (default: all).
        compile: ``True`` or a dict of ``torch.compile`` keyword arguments (``backend``,
            ``mode``, ``dynamic``, ...): compile after wrapping, in place (the model keeps its
            class, ``model.module`` and its state dict keys: no ``_orig_mod.``); see
            :mod:`ddpkit.parallel.compile`. The first forward compiles. Not for ``dp``.
        grad_sync_check_steps: compare the gradients across ranks before the first N optimizer
            steps (:class:`~ddpkit.guards.grad_sync.GradSyncCheck`; ``ddp``). Default: 3 with
            ``compile``, else 0 (off).
        wrap_policy: (``fsdp``) which submodules get their own ``fully_shard``: ``None`` (each
            block of the outermost ``ModuleList``/``Sequential``, else each child of the
            root), a module class or tuple of classes, or ``policy(module) -> bool``.
        reshard_after_forward: (``fsdp``) ``True`` frees each block's gathered parameters after
            its forward (ZeRO-3); ``False`` keeps them for backward (ZeRO-2).
        precision: (``fsdp``) ``32`` or ``bf16-mixed``: FSDP's ``MixedPrecisionPolicy``
            (bfloat16 parameters and compute, float32 gradient reduce-scatter).
        **ddp_kwargs: passed to ``DistributedDataParallel`` (``bucket_cap_mb`` in MiB,
            ``gradient_as_bucket_view``, ``find_unused_parameters``, ``static_graph``, ...).

    Returns:
        The wrapped model (the same module, moved, for ``single``; the same module, sharded
        in place, for ``fsdp``).

    Raises:
        ConfigError: unknown strategy or compression; a keyword ``DistributedDataParallel``
            does not take; the model is already wrapped; ``ddp`` options with an explicit
            ``strategy="single"``/``"dp"``; ``dp`` without 2+ CUDA devices or with several
            processes; ``compile`` not a bool or dict of ``torch.compile`` keywords, with
            ``dp``, or with ``bucket_cap_mb`` below 1 (DDPOptimizer's first bucket); an
            ``fsdp`` option with another strategy, or a DDP option (``grad_compression``,
            ``comm_stats``, DDP keywords) with ``fsdp``.
        DistributedError: ``ddp``, ``zero1`` or ``fsdp`` asked for without a process group
            (world size 1).
        WrappedModelError: (``ddp``, ``zero1``, ``fsdp``) the ranks' models differ in their
            trainable parameters.
        GradSyncError: later, from ``optimizer.step()`` on every rank, when the gradients of
            a checked step differ across ranks (they were not all-reduced).

    Example:
        >>> stats = CommStats()
        >>> ddp_model = wrap_model(Net(), runtime, "ddp", bucket_cap_mb=25,
        ...                        grad_compression="fp16", comm_stats=stats)  # doctest: +SKIP
    """
    if runtime.live is not None:
        return _wrap_live(
            model, runtime, strategy, grad_compression, sync_batchnorm, compile, ddp_kwargs
        )
    fsdp_options = {
        "wrap_policy": wrap_policy,
        "reshard_after_forward": reshard_after_forward,
        "precision": precision,
    }
    _check_strategy_options(strategy, fsdp_options, grad_compression, comm_stats, ddp_kwargs)
    strategy = _check_wrap_args(
        model,
        runtime,
        strategy,
        grad_compression,
        powersgd_rank,
        powersgd_start_step,
        sync_batchnorm,
        ddp_kwargs,
    )
    from ddpkit.parallel.compile import finish_compile, prepare_compile  # imports guards

    options, check_steps = prepare_compile(strategy, compile, grad_sync_check_steps, ddp_kwargs)
    if strategy == "dp":
        from ddpkit.parallel.dp import wrap_data_parallel

        return wrap_data_parallel(model, runtime, device_ids)
    if strategy == "single":
        unused = _ddp_options_given(grad_compression, sync_batchnorm, ddp_kwargs)
        return finish_compile(_single(model, runtime, unused), runtime, strategy, options, 0)
    ddp_options = {
        "grad_compression": grad_compression,
        "comm_stats": comm_stats,
        "powersgd_rank": powersgd_rank,
        "powersgd_start_step": powersgd_start_step,
        "ddp_kwargs": ddp_kwargs,
    }
    wrapped = _wrap_distributed(model, runtime, strategy, sync_batchnorm, fsdp_options, ddp_options)
    if options is None and strategy in ("ddp", "zero1"):  # a compiled forward: no hooks
        _probe_own_loop(wrapped, runtime)
    return finish_compile(wrapped, runtime, strategy, options, check_steps)


def _wrap_distributed(
    model: nn.Module,
    runtime: Runtime,
    strategy: str,
    sync_batchnorm: bool,
    fsdp_options: dict[str, Any],
    ddp_options: dict[str, Any],
) -> nn.Module:
    """``ddp``, ``zero1`` or ``fsdp``: BatchNorm synchronised if asked, then the wrapper."""
    if sync_batchnorm:
        from ddpkit.parallel.syncbn import convert_sync_batchnorm

        model = convert_sync_batchnorm(model, runtime)
    if strategy == "fsdp":
        from ddpkit.parallel.fsdp import wrap_fsdp

        return wrap_fsdp(model, runtime, **fsdp_options)
    return _wrap_ddp(model, runtime, strategy, **ddp_options)


def _probe_own_loop(model: nn.Module, runtime: Runtime) -> None:
    """Straggler figures for the caller's own loop (each ``stop_requested()`` ends a step)."""
    from ddpkit.training.stragglers import attach_loop_probe  # training imports this module

    attach_loop_probe(model.module, runtime)


def _wrap_ddp(
    model: nn.Module,
    runtime: Runtime,
    strategy: str,
    *,
    grad_compression: str,
    comm_stats: CommStats | None,
    powersgd_rank: int,
    powersgd_start_step: int,
    ddp_kwargs: dict[str, Any],
) -> DistributedDataParallel:
    """``ddp`` and ``zero1``: the parameters compared, DDP built, its comm hook, the guard."""
    model = model.to(runtime.device)
    verify_same_parameters(model, runtime)
    if grad_compression == "powersgd":
        ddp_kwargs = powersgd_bucket_cap_mb(model, runtime, ddp_kwargs)
    device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
    ddp_model = DistributedDataParallel(
        model, device_ids=device_ids, process_group=runtime.process_group, **ddp_kwargs
    )
    if grad_compression != "none" or comm_stats is not None:
        register_grad_hook(
            ddp_model,
            runtime,
            grad_compression=grad_compression,
            comm_stats=comm_stats,
            powersgd_rank=powersgd_rank,
            powersgd_start_step=powersgd_start_step,
        )
    WrapGuard(ddp_model, runtime).attach()
    _STRATEGY_OF[ddp_model] = strategy
    return ddp_model


def _wrap_live(
    model: nn.Module,
    runtime: Runtime,
    strategy: str,
    grad_compression: str,
    sync_batchnorm: bool,
    compile: bool | dict[str, Any],
    ddp_kwargs: dict[str, Any],
) -> nn.Module:
    """Live fault tolerance: the plain module, synced by ``TrainStep`` (see
    :mod:`ddpkit.parallel.live`); only ``auto``/``ddp`` without DDP options."""
    from ddpkit.parallel.live import prepare_live_model

    given = [name for name, _ in _ddp_options_given(grad_compression, sync_batchnorm, ddp_kwargs)]
    given += ["compile"] if compile else []
    if strategy not in ("auto", "ddp") or given:
        what = f"strategy={strategy!r}" if strategy not in ("auto", "ddp") else f"{given}"
        raise ConfigError(
            f"live fault tolerance trains data-parallel replicas with plain gradient all-reduce: "
            f"{what} is not supported with it. Use strategy='ddp' (or 'auto') without DDP "
            "options, or fault_tolerance='restart'."
        )
    layer = model
    if isinstance(layer, _WRAPPERS):
        raise ConfigError(
            f"model is already wrapped in {type(layer).__name__}: pass the plain module."
        )
    live = prepare_live_model(model, runtime.device, runtime.process_group)
    _STRATEGY_OF[live] = "live"
    return live


def wrapped_strategy(model: nn.Module) -> str:
    """The strategy ``model`` was wrapped for: ``fsdp``, ``zero1``, ``ddp``, ``dp``, ``live``
    (live fault tolerance) or ``single`` (a module ddpkit did not wrap counts as ``single``,
    or ``ddp``/``dp`` by its wrapper class)."""
    from ddpkit.parallel.fsdp import is_fsdp

    layer = model
    while is_compiled(layer):
        layer = layer._orig_mod
    if is_fsdp(layer):
        return "fsdp"
    if _STRATEGY_OF.get(layer) == "live":
        return "live"
    if isinstance(layer, DistributedDataParallel):
        return _STRATEGY_OF.get(layer, "ddp")
    return "dp" if isinstance(layer, DataParallel) else "single"


def _check_strategy_options(
    strategy: str,
    fsdp_options: dict[str, Any],
    grad_compression: str,
    comm_stats: CommStats | None,
    ddp_kwargs: dict[str, Any],
) -> None:
    """Refuse FSDP options without ``fsdp``, and DDP's gradient-sync options with it (at
    every world size: checked before the process group is looked at).

    Raises:
        ConfigError: one line naming the options, the strategy and the fix.
    """
    if strategy not in STRATEGIES:  # _check_wrap_args names the allowed ones
        return
    fsdp_given = [f"{k}={v!r}" for k, v in fsdp_options.items() if v != _FSDP_DEFAULTS[k]]
    if strategy != "fsdp" and fsdp_given:
        raise ConfigError(
            f"FSDP options {', '.join(fsdp_given)} given for strategy={strategy!r}: they "
            "configure fully_shard. Use strategy='fsdp', or drop them (mixed precision for "
            "DDP is ddpkit.MixedPrecision in the training step)."
        )
    ddp_given = [f"grad_compression={grad_compression!r}"] if grad_compression != "none" else []
    ddp_given += ["comm_stats=CommStats(...)"] if comm_stats is not None else []
    ddp_given += [f"{k}={v!r}" for k, v in sorted(ddp_kwargs.items())]
    if strategy == "fsdp" and ddp_given:
        raise ConfigError(
            f"DDP options {', '.join(ddp_given)} given for strategy='fsdp': FSDP reduce-"
            "scatters gradients itself, without DDP's buckets or comm hooks. Drop them, or "
            "use strategy='ddp' or 'zero1'."
        )


def _check_wrap_args(
    model: nn.Module,
    runtime: Runtime,
    strategy: str,
    grad_compression: str,
    powersgd_rank: int,
    powersgd_start_step: int,
    sync_batchnorm: bool,
    ddp_kwargs: dict[str, Any],
) -> str:
    """Validate :func:`wrap_model`'s arguments; return the strategy with ``auto`` resolved."""
    if strategy not in STRATEGIES:
        raise ConfigError(
            f"unknown strategy: strategy={strategy!r}. Allowed: {', '.join(STRATEGIES)}."
        )
    layer = model
    while is_compiled(layer):  # torch.compile(DDP(m)) is wrapped too
        layer = layer._orig_mod
    if isinstance(layer, _WRAPPERS):
        raise ConfigError(
            f"model is already wrapped in {type(layer).__name__}: wrapping twice would sync "
            "gradients twice. Pass the plain module (ddpkit.unwrap_model(model))."
        )
    check_compression(grad_compression, powersgd_rank, powersgd_start_step)
    _check_ddp_kwargs(ddp_kwargs)
    given = [name for name, _ in _ddp_options_given(grad_compression, sync_batchnorm, ddp_kwargs)]
    if strategy in ("single", "dp") and given:  # explicit: auto at world size 1 ignores them
        raise ConfigError(
            f"DDP options {given} given for strategy={strategy!r}: they configure "
            "DistributedDataParallel's gradient sync. Drop them, use strategy='ddp', or "
            "strategy='auto' (at world_size=1 they then do nothing)."
        )
    if strategy == "auto":
        strategy = "ddp" if runtime.world_size > 1 else "single"
    if strategy in ("ddp", "zero1", "fsdp") and runtime.process_group is None:
        raise DistributedError(
            f"strategy={strategy!r} needs a process group, and world_size=1 has none. Launch "
            "several processes (ddpkit run -n 2 ... / torchrun), or use strategy='single'."
        )
    return strategy


def _single(model: nn.Module, runtime: Runtime, unused: list[tuple[str, Any]]) -> nn.Module:
    """``strategy="auto"`` at world size 1: the module on the device; ``unused`` DDP options
    (only ``auto`` gets here with any) are said to do nothing, in the same info line."""
    note = ", ".join(f"{name}={value!r}" for name, value in unused)
    get_logger("parallel").info(
        "wrap_model: world_size=1, so the module itself is returned (no DDP wrapper, no "
        ".module); reach its attributes with ddpkit.unwrap_model(model).x, which also works "
        "under DDP.%s",
        f" {note}: DDP options, in effect with 2 or more processes; at world_size=1 they do "
        "nothing."
        if note
        else "",
    )
    return model.to(runtime.device)


def _ddp_options_given(
    grad_compression: str, sync_batchnorm: bool, ddp_kwargs: dict[str, Any]
) -> list[tuple[str, Any]]:
    """``(name, value)`` of each DDP-only option given (not at its default)."""
    given = [("grad_compression", grad_compression)] if grad_compression != "none" else []
    given += [("sync_batchnorm", True)] if sync_batchnorm else []
    return given + sorted(ddp_kwargs.items())


@functools.cache
def _ddp_keywords() -> frozenset[str]:
    """The keywords ``DistributedDataParallel`` takes that ``wrap_model`` does not set itself."""
    names = inspect.signature(DistributedDataParallel.__init__).parameters
    return frozenset(names) - {"self", "module", "device_ids", "process_group"}


def _check_ddp_kwargs(ddp_kwargs: dict[str, Any]) -> None:
    """Refuse keywords DDP does not take, at every world size (a typo must not wait for 2+).

    Raises:
        ConfigError: names each unknown keyword and the ones DDP takes.
    """
    unknown = sorted(set(ddp_kwargs) - _ddp_keywords())
    if unknown:
        given = ", ".join(f"{name}={ddp_kwargs[name]!r}" for name in unknown)
        raise ConfigError(
            f"unknown DDP option for wrap_model: {given}. DistributedDataParallel takes "
            f"{', '.join(sorted(_ddp_keywords()))} (wrap_model sets device_ids and "
            "process_group). Fix the name or drop it."
        )


def model_state_dict(model: nn.Module, *, sharded: bool = False) -> dict[str, torch.Tensor]:
    """The state dict of the unwrapped model: keys never start with ``module.`` or
    ``_orig_mod.`` (DDP, DataParallel and ``torch.compile`` wrappers removed).

    For an ``fsdp`` model it is a collective (call on every rank): the full state dict,
    gathered to CPU, on rank 0 and ``{}`` on the other ranks (torch's
    ``get_model_state_dict(full_state_dict=True, cpu_offload=True)``); ``sharded=True`` gives
    every rank its shards instead (``DTensor`` values, what ``torch.distributed.checkpoint``
    saves), without communication. For the other strategies every rank gets the whole dict,
    and ``sharded`` changes nothing.

    Example:
        >>> state = model_state_dict(model)                # every rank calls it  # doctest: +SKIP
        >>> if rt.is_rank_zero:
        ...     torch.save(state, "model.pt")
    """
    from ddpkit.parallel.fsdp import is_fsdp

    inner = unwrap_model(model)
    if not is_fsdp(inner):
        return inner.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = not sharded
    options = StateDictOptions(full_state_dict=full, cpu_offload=full)
    return get_model_state_dict(inner, options=options)
