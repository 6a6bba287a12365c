"""Wrap a model for a strategy, and unwrap it for saving and evaluation.

The strategies are objects, each with its options, its checks and its wrapping (see
:mod:`ddpkit.parallel.strategy`: ``Auto``, ``Single``, ``DDP``, ``ZeRO1``, ``FSDP``,
``DataParallel``, ``Live``); :func:`wrap_model` adds what applies to all of them: the check that
the model is not wrapped yet, ``compile`` (``torch.compile`` in place, in torch's order, with
the first steps' gradients checked: see :mod:`ddpkit.parallel.compile`), and the record of the
strategy (:func:`wrapped_strategy`). Strategy names with keyword options (``strategy="ddp",
bucket_cap_mb=25``) build the same objects.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, cast

import torch
from torch import nn

from ddpkit.errors import ConfigError
from ddpkit.parallel.choices import STRATEGIES  # torch-free: the train flags read them
from ddpkit.parallel.comm import check_compression
from ddpkit.parallel.compile import finish_compile, prepare_compile
from ddpkit.parallel.rules import (
    ddp_options_with_fsdp,
    ddp_options_without_ddp,
    fsdp_options_without_fsdp,
    live_problem,
)
from ddpkit.parallel.strategy import (
    DDP,
    FSDP,
    Auto,
    DataParallel,
    Live,
    Single,
    Strategy,
    record_strategy,
    strategy_class,
    wrapped_strategy,
)
from ddpkit.runtime.process_group import Runtime
from ddpkit.wrappers import WRAPPERS, is_compiled, is_fsdp, uncompiled, unwrap_model

__all__ = ["is_compiled", "model_state_dict", "unwrap_model", "wrap_model", "wrapped_strategy"]

# FSDP's own options and their defaults (sync_batchnorm is DDP's too)
_FSDP_DEFAULTS = {
    f.name: f.default for f in dataclasses.fields(FSDP) if f.name not in DDP.__dataclass_fields__
}
# DDP's comm hook options, named one by one (the rest of DDP's options are its keywords)
_HOOK_DEFAULTS = {
    name: p.default
    for name, p in inspect.signature(DDP).parameters.items()
    if name not in ("bucket_cap_mb", "sync_batchnorm", "extra") and p.kind is p.KEYWORD_ONLY
}


def wrap_model(
    model: nn.Module,
    runtime: Runtime,
    *,
    strategy: Strategy | str = "auto",
    compile: bool | dict[str, Any] = False,
    grad_sync_check_steps: int | None = None,
    **options: Any,
) -> nn.Module:
    """Move ``model`` to the rank's device and wrap it for ``strategy``.

    Collective (for ``DDP``, ``ZeRO1``, ``FSDP``): call on every rank; DDP broadcasts rank 0's
    parameters and buffers, so all replicas start identical.

    Guarded by default (DDP, see :mod:`ddpkit.guards.wrapped`): the ranks' trainable
    parameters are compared first, and from then on a parameter frozen, unfrozen or assigned
    after wrapping, or a backward that bypassed the wrapper's forward (``model.module(x)``),
    raises :class:`~ddpkit.guards.wrapped.WrappedModelError` at the next step. To change the
    model, wrap again: ``wrap_model(unwrap_model(model), runtime)``.

    At world size 1 (``Auto()`` -> ``Single()``) the module itself is returned, without a DDP
    wrapper: reach its own attributes through :func:`unwrap_model` (``unwrap_model(model).x``),
    which works at every world size, never ``model.x`` or ``model.module.x``. ``Auto``'s DDP
    options do nothing there, said in the same info line, so one script runs unchanged as
    ``python train.py`` and under a launcher; their values are still checked.

    Args:
        model: an unwrapped ``nn.Module``.
        runtime: the job's :class:`Runtime`.
        strategy: a strategy object of :mod:`ddpkit.parallel.strategy` (``Auto()``,
            ``Single()``, ``DDP(...)``, ``ZeRO1(...)``, ``FSDP(...)``, ``DataParallel(...)``,
            ``Live()``), which holds the strategy's options; or its name (``auto``, ``single``,
            ``ddp``, ``dp``, ``zero1``, ``fsdp``) with the options as keyword arguments, as in
            earlier releases (``strategy="ddp", bucket_cap_mb=25``): the same object is built.
            Under live fault tolerance ``Auto()``/``DDP()`` without options mean ``Live()``.
        compile: ``True`` or a dict of ``torch.compile`` keyword arguments (``backend``,
            ``mode``, ``dynamic``, ...): compile after wrapping, in place (the model keeps its
            class, ``model.module`` and its state dict keys: no ``_orig_mod.``); see
            :mod:`ddpkit.parallel.compile`. The first forward compiles. Not for ``dp``.
        grad_sync_check_steps: compare the gradients across ranks before the first N optimizer
            steps (:class:`~ddpkit.guards.grad_sync.GradSyncCheck`; DDP; ignored under live
            fault tolerance). Default: 3 with ``compile``, else 0 (off).
        **options: with a strategy name only: the options of its object (``sync_batchnorm``,
            ``grad_compression``, ``comm_stats``, ``powersgd_rank``, ``powersgd_start_step``,
            ``device_ids``, ``wrap_policy``, ``reshard_after_forward``, ``precision``, and
            ``DistributedDataParallel``'s keywords such as ``bucket_cap_mb``).

    Returns:
        The wrapped model (the same module, moved, for ``single``; the same module, sharded
        in place, for ``fsdp``). :func:`wrapped_strategy` tells its strategy object.

    Raises:
        ConfigError: unknown strategy; a bad option (see each strategy); options given with a
            strategy object, or of another strategy (``strategy="single"`` with DDP's,
            ``"fsdp"`` with DDP's, any other with FSDP's); the model is already wrapped;
            ``dp`` without 2+ CUDA devices or with several processes; ``compile`` not a bool
            or dict of ``torch.compile`` keywords, with ``dp``, or with ``bucket_cap_mb``
            below 1 (DDPOptimizer's first bucket); under live fault tolerance, a strategy
            other than ``Auto()``/``DDP()``/``Live()``, DDP options or ``compile``.
        DistributedError: ``ddp``, ``zero1`` or ``fsdp`` asked for without a process group
            (world size 1).
        WrappedModelError: (``ddp``, ``zero1``, ``fsdp``) the ranks' models differ in their
            trainable parameters.
        GradSyncError: later, from ``optimizer.step()`` on every rank, when the gradients of
            a checked step differ across ranks (they were not all-reduced).

    Example (one process; on 2+ ranks the same call returns the ``DistributedDataParallel``
    wrapper, and ``wrapped_strategy`` that ``DDP(bucket_cap_mb=25)``):
        >>> from ddpkit.env import ProcessInfo
        >>> from ddpkit.parallel.strategy import DDP, Auto
        >>> runtime = Runtime(ProcessInfo())  # world size 1
        >>> model = wrap_model(nn.Linear(2, 2), runtime, strategy=Auto(ddp=DDP(bucket_cap_mb=25)))
        >>> type(model).__name__, wrapped_strategy(model)
        ('Linear', Single())
    """
    strategy = _as_strategy(strategy, options)
    if runtime.live is not None:
        strategy = _live_strategy(strategy, compile)
    _refuse_wrapped(model)
    resolved = strategy.resolve(runtime.world_size)
    resolved.check_runtime(runtime)
    compile_options, check_steps = prepare_compile(resolved, compile, grad_sync_check_steps)
    wrapped = resolved.wrap(model, runtime)
    record_strategy(wrapped, resolved)
    if compile_options is None and resolved.ddp_gradients:  # a compiled forward: no hooks
        _probe_own_loop(wrapped, runtime)
    return finish_compile(wrapped, runtime, resolved, compile_options, check_steps)


def _probe_own_loop(model: nn.Module, runtime: Runtime) -> None:
    """Straggler figures for the caller's own loop (each ``stop_requested()`` ends a step)."""
    from ddpkit.monitoring.stragglers import attach_loop_probe  # training imports this module

    attach_loop_probe(model.module, runtime)


def _refuse_wrapped(model: nn.Module) -> None:
    """Raises ConfigError: ``model`` is a DDP/DataParallel wrapper (also inside compile)."""
    layer = uncompiled(model)  # torch.compile(DDP(m)) is wrapped too
    if isinstance(layer, WRAPPERS):
        raise ConfigError(
            f"model is already wrapped in {type(layer).__name__}: wrapping twice would sync "
            "gradients twice. Pass the plain module (ddpkit.unwrap_model(model))."
        )


def _as_strategy(strategy: Strategy | str, options: dict[str, Any]) -> Strategy:
    """The strategy object of ``wrap_model``'s ``strategy`` (a name builds it from ``options``).

    Raises:
        ConfigError: unknown name; options with an object; options of another strategy.
    """
    if isinstance(strategy, Strategy):
        if options:
            given = ", ".join(f"{k}={v!r}" for k, v in sorted(options.items()))
            raise ConfigError(
                f"wrap_model options {given} given with strategy={strategy!r}: a strategy "
                f"object holds its own options. Pass them to it ({type(strategy).__name__}"
                "(...)), or pass the strategy's name."
            )
        return strategy
    if strategy not in STRATEGIES:
        raise ConfigError(
            f"unknown strategy: strategy={strategy!r}. Allowed: {', '.join(STRATEGIES)}."
        )
    return _strategy_from_name(strategy, dict(options))


def _strategy_from_name(name: str, options: dict[str, Any]) -> Strategy:
    """Build the object of the strategy ``name`` from the keyword options of earlier releases,
    with the refusals and messages they had."""
    fsdp = {k: options.pop(k) for k in _FSDP_DEFAULTS if k in options}
    device_ids = options.pop("device_ids", None)
    sync_batchnorm = options.pop("sync_batchnorm", False)
    cls = strategy_class(name)
    _refuse_other_options(name, cls, fsdp, options)
    if cls is FSDP:  # DDP's options refused above
        return FSDP(sync_batchnorm=sync_batchnorm, **fsdp)
    if issubclass(cls, DDP):  # ddp, zero1
        return cls(sync_batchnorm=sync_batchnorm, **options)
    ddp = DDP(sync_batchnorm=sync_batchnorm, **options)  # checks compression and keywords
    if cls is Auto:
        return Auto(ddp=ddp)
    # explicit: auto at world size 1 ignores them
    problem = ddp_options_without_ddp(name, [f"{k}={v!r}" for k, v in ddp.given()])
    if problem:
        raise ConfigError(f"{problem}.")
    return DataParallel(device_ids=device_ids) if cls is DataParallel else Single()


def _refuse_other_options(
    name: str, cls: type[Strategy], fsdp: dict[str, Any], options: dict[str, Any]
) -> None:
    """Refuse FSDP options without ``fsdp``, and DDP's gradient-sync options with it (at
    every world size: checked before the process group is looked at): each comm hook option
    not at its default, PowerSGD's settings included, and every DDP keyword.

    Raises:
        ConfigError: one line naming the options, the strategy and the fix; with ``fsdp``, an
            invalid compression or PowerSGD setting (``invalid gradient compression``, as
            ``DDP(...)`` says it).
    """
    fsdp_given = [f"{k}={v!r}" for k, v in fsdp.items() if v != _FSDP_DEFAULTS[k]]
    problem = fsdp_options_without_fsdp(cls.name, fsdp_given)
    if problem:
        raise ConfigError(f"{problem}.")
    if cls is not FSDP:
        return
    hooks = {**_HOOK_DEFAULTS, **{k: v for k, v in options.items() if k in _HOOK_DEFAULTS}}
    check_compression(
        hooks["grad_compression"], hooks["powersgd_rank"], hooks["powersgd_start_step"]
    )
    ddp_given = [
        "comm_stats=CommStats(...)" if k == "comm_stats" else f"{k}={v!r}"
        for k, v in hooks.items()
        if v != _HOOK_DEFAULTS[k]
    ]
    ddp_given += [f"{k}={v!r}" for k, v in sorted(options.items()) if k not in _HOOK_DEFAULTS]
    problem = ddp_options_with_fsdp(cls.name, ddp_given)
    if problem:
        raise ConfigError(f"{problem}.")


def _live_strategy(strategy: Strategy, compile: bool | dict[str, Any]) -> Strategy:
    """Under live fault tolerance: :class:`Live` for ``Auto()``/``DDP()`` without options
    (plain gradient all-reduce in ``TrainStep``, see :mod:`ddpkit.parallel.live`).

    Raises:
        ConfigError: another strategy, DDP options, or ``compile``.
    """
    inner = strategy.ddp if isinstance(strategy, Auto) else strategy
    given = [f"{k}={v!r}" for k, v in inner.given()] if type(inner) is DDP else []
    given += [f"compile={compile!r}"] if compile else []
    problem = live_problem(inner.name, given)
    if problem:
        raise ConfigError(f"{problem}.")
    return Live()


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
        >>> state = model_state_dict(nn.DataParallel(nn.Linear(2, 2)))  # every rank calls it
        >>> list(state)  # then torch.save(state, "model.pt") on rank 0
        ['weight', 'bias']
    """
    inner = unwrap_model(model)
    if not is_fsdp(inner):
        return inner.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = not sharded
    options = StateDictOptions(full_state_dict=full, cpu_offload=full)
    return cast(dict[str, torch.Tensor], get_model_state_dict(inner, options=options))
