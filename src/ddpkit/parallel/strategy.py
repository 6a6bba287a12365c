"""One object per strategy: its options, its resolution for a world size, its checks, its wrapping.

:func:`ddpkit.wrap_model` takes one of these (``strategy=DDP(bucket_cap_mb=25)``); the strings
of earlier releases (``strategy="ddp"`` with keyword options) build the same objects.

- :class:`Auto`: :class:`DDP` at world size 2 or more, else :class:`Single` (its DDP options
  then do nothing, said in one info line), so one script runs as ``python train.py`` and under
  a launcher. The default.
- :class:`Single`: the model on this rank's device, no gradient sync (one process).
- :class:`DDP`: ``torch.nn.parallel.DistributedDataParallel`` over the runtime's training group;
  its gradient buckets all-reduce during backward (overlap), tuned by ``bucket_cap_mb``.
- :class:`ZeRO1`: DDP exactly as :class:`DDP`; the optimizer state is sharded by torch's
  ``ZeroRedundancyOptimizer`` (build it with :func:`ddpkit.build_zero_optimizer`).
- :class:`FSDP`: torch's FSDP2 ``fully_shard`` on each block and the root (see
  :mod:`ddpkit.parallel.fsdp`).
- :class:`DataParallel`: ``torch.nn.DataParallel`` over 2+ CUDA devices in one process (PyTorch,
  and ddpkit, recommend DDP instead).
- :class:`Live`: live fault tolerance: the plain module, its gradients all-reduced by
  :class:`~ddpkit.TrainStep` on the current quorum (see :mod:`ddpkit.parallel.live`).

Each validates its options when it is built (a bad value is one :class:`~ddpkit.ConfigError`
line; an option of another strategy is a ``TypeError``), and is immutable.

Example:
    >>> from ddpkit.parallel.strategy import DDP, FSDP, Auto, Single
    >>> ddp = DDP(bucket_cap_mb=25, grad_compression="bf16")
    >>> ddp.name, ddp.ddp_kwargs()
    ('ddp', {'bucket_cap_mb': 25})
    >>> Auto(ddp=ddp).resolve(world_size=4) == ddp, Auto().resolve(world_size=1)
    (True, Single())
    >>> DDP().problems(world_size=1)
    ["strategy='ddp' with world_size=1. It needs 2 or more processes. Use strategy='single', or start 2 or more processes (ddpkit run -n 2, ddpkit train --nproc 2, torchrun --nproc-per-node 2)"]
    >>> FSDP(grad_compression="fp16")
    Traceback (most recent call last):
    TypeError: FSDP.__init__() got an unexpected keyword argument 'grad_compression'
    >>> DDP(grad_compression="int8")
    Traceback (most recent call last):
    ddpkit.errors.ConfigError: invalid gradient compression: grad_compression='int8' is not one of none, fp16, bf16, powersgd.
"""  # noqa: E501 (the doctest output lines are as long as the messages)

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpkit.errors import ConfigError, DistributedError
from ddpkit.guards.wrapped import WrapGuard, verify_same_parameters
from ddpkit.log import get_logger
from ddpkit.parallel.choices import (
    FSDP_PRECISION,
    FSDP_RESHARD_AFTER_FORWARD,
    POWERSGD_RANK,
    POWERSGD_START_STEP,
    resolved_strategy,
    strategy_problems,
)
from ddpkit.parallel.comm import (
    CommStats,
    check_compression,
    powersgd_bucket_cap_mb,
    register_grad_hook,
)
from ddpkit.parallel.dp import wrap_data_parallel
from ddpkit.parallel.fsdp import WrapPolicy, check_fsdp_options, is_sharded_tensor, wrap_fsdp
from ddpkit.parallel.live import prepare_live_model
from ddpkit.parallel.rules import loss_scaler_with_fsdp
from ddpkit.parallel.syncbn import convert_sync_batchnorm
from ddpkit.parallel.zero import is_zero_optimizer
from ddpkit.runtime.process_group import Runtime
from ddpkit.wrappers import is_fsdp, uncompiled

__all__ = [
    "DDP",
    "FSDP",
    "Auto",
    "DataParallel",
    "Live",
    "Single",
    "Strategy",
    "ZeRO1",
    "strategy_class",
    "wrapped_strategy",
]

# the attribute of a wrapped model (what wrap_model returns) holding its strategy: it lives and
# dies with the model (a global map would keep the model alive through a wrap_policy closure)
_STRATEGY_ATTRIBUTE = "_ddpkit_strategy"


@dataclass(frozen=True)
class Strategy:
    """What every strategy answers; subclasses hold their own options.

    Attributes:
        name: the strategy's name in flags, configs and messages (``ddp``, ``fsdp``, ...).
        ddp_gradients: its gradients are all-reduced by a ``DistributedDataParallel`` wrapper
            (``ddp``, ``zero1``): comm hooks, ``no_sync()`` and the gradient sync check apply.
    """

    name: ClassVar[str] = ""
    ddp_gradients: ClassVar[bool] = False

    def resolve(self, world_size: int) -> Strategy:
        """The strategy that runs at ``world_size`` (itself, except for :class:`Auto`)."""
        return self

    def problems(self, world_size: int) -> list[str]:
        """Why it cannot run with ``world_size`` processes (``[]``: it can), one line each
        (see :func:`ddpkit.parallel.choices.strategy_problems`)."""
        return strategy_problems(self.name, world_size)

    def check_runtime(self, runtime: Runtime) -> None:
        """Refuse a runtime the strategy cannot wrap on (before anything is built).

        Raises:
            DistributedError: a strategy of several processes without a process group (the
                line of :meth:`problems` at world size 1).
        """
        # without a process group this rank is alone. The one-process strategies are not
        # refused here at 2+ ranks: dp refuses itself when wrapping (ConfigError), and single
        # was always allowed there (each rank its own model)
        problems = self.problems(world_size=1) if runtime.process_group is None else []
        if problems:
            raise DistributedError(f"{problems[0]}.")

    def wrap(self, model: nn.Module, runtime: Runtime) -> nn.Module:
        """``model`` on the runtime's device, wrapped for this strategy (subclasses)."""
        raise NotImplementedError

    def check_optimizer(self, optimizer: torch.optim.Optimizer, *, loss_scaled: bool) -> None:
        """Refuse an optimizer (or a loss scaler) that silently undoes the strategy; see
        :class:`ZeRO1` and :class:`FSDP`. Nothing for the others."""


@dataclass(frozen=True)
class Single(Strategy):
    """One process: the module itself on the runtime's device, no wrapper, no gradient sync."""

    name: ClassVar[str] = "single"
    # the DDP options Auto carried to world size 1, named in the info line (not an option)
    _ignored: tuple[tuple[str, Any], ...] = field(default=(), init=False, repr=False, compare=False)

    def wrap(self, model: nn.Module, runtime: Runtime) -> nn.Module:
        """The module moved to ``runtime.device``; one info line (reach its attributes through
        :func:`ddpkit.unwrap_model`, which also works under DDP)."""
        note = ", ".join(f"{name}={value!r}" for name, value in self._ignored)
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


@functools.cache
def _ddp_keywords() -> frozenset[str]:
    """The keywords ``DistributedDataParallel`` takes that ddpkit does not set itself."""
    names = inspect.signature(DistributedDataParallel.__init__).parameters
    return frozenset(names) - {"self", "module", "device_ids", "process_group"}


def check_ddp_kwargs(ddp_kwargs: Mapping[str, Any]) -> None:
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


@dataclass(frozen=True, init=False)
class DDP(Strategy):
    """``DistributedDataParallel``: each rank a replica, gradients all-reduced in buckets during
    backward. Collective to wrap (rank 0's parameters and buffers are broadcast).

    ddpkit's strategy object, not torch's wrapper class: a wrapped model is a
    ``DistributedDataParallel`` (``isinstance(model, ddpkit.DDP)`` is False); ask
    ``ddpkit.wrapped_strategy(model)`` which strategy wrapped it.

    Args:
        bucket_cap_mb: DDP's gradient bucket size in MiB (``None``: torch's 25).
        grad_compression: ``none``, ``fp16``, ``bf16`` or ``powersgd``: the DDP comm hook that
            all-reduces gradients (see :mod:`ddpkit.parallel.comm`).
        comm_stats: a :class:`~ddpkit.CommStats` to count the gradient bytes in. With ``none``
            and no ``comm_stats`` no hook is registered (DDP's built-in all-reduce).
        powersgd_rank: rank of PowerSGD's low-rank factors (``powersgd`` only).
        powersgd_start_step: backward passes with plain all-reduce before PowerSGD starts.
        sync_batchnorm: convert every BatchNorm layer to ``SyncBatchNorm`` before wrapping.
        extra: the other keywords of ``DistributedDataParallel`` as a mapping (what the repr
            and ``dataclasses.replace`` pass back), merged with ``**ddp_kwargs``; kept
            read-only as ``self.extra``.
        **ddp_kwargs: the other keywords of ``DistributedDataParallel``
            (``find_unused_parameters``, ``static_graph``, ``gradient_as_bucket_view``, ...).

    Raises:
        ConfigError: an unknown compression, bad PowerSGD settings, a keyword DDP does not take.
    """

    name: ClassVar[str] = "ddp"
    ddp_gradients: ClassVar[bool] = True
    bucket_cap_mb: float | None
    grad_compression: str
    comm_stats: CommStats | None = field(hash=False)
    powersgd_rank: int
    powersgd_start_step: int
    sync_batchnorm: bool
    # the remaining DDP keywords, read-only (``extra`` and ``**ddp_kwargs`` together: what
    # dataclasses.replace and the repr pass back)
    extra: Mapping[str, Any] = field(hash=False)

    def __init__(
        self,
        *,
        bucket_cap_mb: float | None = None,
        grad_compression: str = "none",
        comm_stats: CommStats | None = None,
        powersgd_rank: int = POWERSGD_RANK,
        powersgd_start_step: int = POWERSGD_START_STEP,
        sync_batchnorm: bool = False,
        extra: Mapping[str, Any] | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        ddp_kwargs = {**(extra or {}), **ddp_kwargs}
        check_compression(grad_compression, powersgd_rank, powersgd_start_step)
        check_ddp_kwargs(ddp_kwargs)
        values = {
            "bucket_cap_mb": bucket_cap_mb,
            "grad_compression": grad_compression,
            "comm_stats": comm_stats,
            "powersgd_rank": powersgd_rank,
            "powersgd_start_step": powersgd_start_step,
            "sync_batchnorm": sync_batchnorm,
            "extra": types.MappingProxyType(ddp_kwargs),
        }
        for key, value in values.items():
            object.__setattr__(self, key, value)

    def __reduce__(self) -> tuple[Any, ...]:
        # pickled and deep-copied through __init__ (a mappingproxy pickles as nothing else)
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return functools.partial(type(self), **{**values, "extra": dict(self.extra)}), ()

    def ddp_kwargs(self) -> dict[str, Any]:
        """The keywords passed on to ``DistributedDataParallel`` (only those given)."""
        cap = {} if self.bucket_cap_mb is None else {"bucket_cap_mb": self.bucket_cap_mb}
        return {**cap, **self.extra}

    def given(self) -> list[tuple[str, Any]]:
        """``(name, value)`` of each option that changes the gradient sync (not at its default;
        ``comm_stats`` only counts)."""
        given: list[tuple[str, Any]] = []
        if self.grad_compression != "none":
            given.append(("grad_compression", self.grad_compression))
        given += [("sync_batchnorm", True)] if self.sync_batchnorm else []
        return given + sorted(self.ddp_kwargs().items())

    def wrap(self, model: nn.Module, runtime: Runtime) -> nn.Module:
        """BatchNorm synchronised if asked; parameters compared; DDP, its comm hook, the guard.

        Collective: call on every rank (DDP broadcasts rank 0's parameters and buffers).

        Raises:
            WrappedModelError: the ranks' models differ in their trainable parameters.
        """
        model = convert_sync_batchnorm(model, runtime) if self.sync_batchnorm else model
        model = model.to(runtime.device)
        verify_same_parameters(model, runtime)
        ddp_kwargs = self.ddp_kwargs()
        if self.grad_compression == "powersgd":
            ddp_kwargs = powersgd_bucket_cap_mb(model, runtime, ddp_kwargs)
        device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
        ddp_model = DistributedDataParallel(
            model, device_ids=device_ids, process_group=runtime.process_group, **ddp_kwargs
        )
        if self.grad_compression != "none" or self.comm_stats is not None:
            register_grad_hook(
                ddp_model,
                runtime,
                grad_compression=self.grad_compression,
                comm_stats=self.comm_stats,
                powersgd_rank=self.powersgd_rank,
                powersgd_start_step=self.powersgd_start_step,
            )
        WrapGuard(ddp_model, runtime).attach()
        return ddp_model


@dataclass(frozen=True, init=False)
class ZeRO1(DDP):
    """:class:`DDP` for the model, with the optimizer state sharded by torch's
    ``ZeroRedundancyOptimizer`` (build it with :func:`ddpkit.build_zero_optimizer`, which
    :class:`~ddpkit.TrainStep` checks). Takes DDP's options."""

    name: ClassVar[str] = "zero1"

    def check_optimizer(self, optimizer: torch.optim.Optimizer, *, loss_scaled: bool) -> None:
        """Raises:
        ConfigError: the optimizer is not a ``ZeroRedundancyOptimizer`` (the state would
            stay whole on every rank)."""
        if not is_zero_optimizer(optimizer):
            raise ConfigError(
                f"strategy='zero1' with a {type(optimizer).__name__}: ZeRO-1 shards the "
                "optimizer state, and this optimizer keeps all of it on every rank. Build it "
                "with ddpkit.build_zero_optimizer(model.parameters(), runtime, "
                "optimizer_class=...)."
            )


@dataclass(frozen=True, kw_only=True)
class FSDP(Strategy):
    """torch's FSDP2 ``fully_shard`` on each block the policy picks, then on the root:
    parameters, gradients and optimizer state sharded. Collective to wrap.

    ddpkit's strategy object, not torch's FSDP class: ``isinstance(model, ddpkit.FSDP)`` is
    False for a sharded model; ask ``ddpkit.wrapped_strategy(model)`` which strategy wrapped it.

    Args:
        wrap_policy: which submodules get their own ``fully_shard``: ``None`` (each block of the
            outermost ``ModuleList``/``Sequential``, else each child of the root), a module
            class or tuple of classes, or ``policy(module) -> bool``.
        reshard_after_forward: ``True`` frees each block's gathered parameters after its forward
            (ZeRO-3); ``False`` keeps them for backward (ZeRO-2).
        precision: ``32`` or ``bf16-mixed`` (FSDP's ``MixedPrecisionPolicy``: bfloat16
            parameters and compute, float32 gradient reduce-scatter).
        sync_batchnorm: convert every BatchNorm layer to ``SyncBatchNorm`` before sharding.

    Raises:
        ConfigError: a wrap policy, ``reshard_after_forward`` or precision of another kind.
    """

    name: ClassVar[str] = "fsdp"
    wrap_policy: WrapPolicy = field(default=None, hash=False)
    reshard_after_forward: bool = FSDP_RESHARD_AFTER_FORWARD
    precision: str = FSDP_PRECISION
    sync_batchnorm: bool = False

    def __post_init__(self) -> None:
        check_fsdp_options(self.wrap_policy, self.reshard_after_forward, self.precision)

    def wrap(self, model: nn.Module, runtime: Runtime) -> nn.Module:
        """The module sharded in place (see :func:`ddpkit.parallel.fsdp.wrap_fsdp`).

        Collective: call on every rank (a parameter comparison, then FSDP's own setup).

        Raises:
            WrappedModelError: the ranks' models differ in their trainable parameters.
        """
        model = convert_sync_batchnorm(model, runtime) if self.sync_batchnorm else model
        return wrap_fsdp(
            model,
            runtime,
            wrap_policy=self.wrap_policy,
            reshard_after_forward=self.reshard_after_forward,
            precision=self.precision,
        )

    def check_optimizer(self, optimizer: torch.optim.Optimizer, *, loss_scaled: bool) -> None:
        """Raises:
        ConfigError: the optimizer holds parameters that are not the shards (built before
            wrapping), or a loss scaler (``16-mixed``) would step sharded gradients."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not all(is_sharded_tensor(p) for p in params):
            raise ConfigError(
                "strategy='fsdp': the optimizer holds parameters that are not the model's "
                "shards (it was built before wrap_model, which replaces them). Build the "
                "optimizer after wrapping: torch.optim.AdamW(model.parameters(), ...)."
            )
        problem = loss_scaler_with_fsdp("16-mixed", self.name) if loss_scaled else None
        if problem:
            raise ConfigError(f"{problem}.")


@dataclass(frozen=True, kw_only=True)
class DataParallel(Strategy):
    """``torch.nn.DataParallel`` over 2+ CUDA devices in one process (see
    :mod:`ddpkit.parallel.dp`; PyTorch, and ddpkit, recommend :class:`DDP` instead).

    ddpkit's strategy object, not torch's wrapper class: a wrapped model is a
    ``torch.nn.DataParallel`` (``isinstance(model, ddpkit.DataParallel)`` is False); ask
    ``ddpkit.wrapped_strategy(model)`` which strategy wrapped it.

    Args:
        device_ids: the CUDA devices (default: all); checked when wrapping.
    """

    name: ClassVar[str] = "dp"
    device_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.device_ids is not None:
            object.__setattr__(self, "device_ids", tuple(self.device_ids))

    def wrap(self, model: nn.Module, runtime: Runtime) -> nn.Module:
        """``DataParallel`` over the devices (refused without 2 of them or with 2+ processes)."""
        ids = None if self.device_ids is None else list(self.device_ids)
        return wrap_data_parallel(model, runtime, ids)


@dataclass(frozen=True, kw_only=True)
class Live(Strategy):
    """Live fault tolerance (``ddpkit run --fault-tolerance live``): the plain module, its
    gradients all-reduced by :class:`~ddpkit.TrainStep` on the current quorum (no DDP wrapper a
    dying peer would break); see :mod:`ddpkit.parallel.live`. Takes no options."""

    name: ClassVar[str] = "live"

    def wrap(self, model: nn.Module, runtime: Runtime) -> nn.Module:
        """The module on the device, rank 0's state broadcast, forwards outside ``TrainStep``
        refused. Collective over the quorum's group.

        Raises:
            ConfigError: the runtime is not live fault-tolerant.
        """
        if runtime.live is None:
            raise ConfigError(
                "strategy=Live() without live fault tolerance: its gradients are all-reduced on "
                "a live quorum, and this runtime has none. Launch with ddpkit run "
                "--fault-tolerance live, or use DDP()."
            )
        return prepare_live_model(model, runtime.device, runtime.process_group)


@dataclass(frozen=True, kw_only=True)
class Auto(Strategy):
    """:class:`DDP` (``ddp``, with its options) at world size 2 or more, else :class:`Single`,
    where the DDP options do nothing (named in its info line). The one place ``auto`` is
    resolved.

    Raises:
        ConfigError: ``ddp`` is not a :class:`DDP` (or :class:`ZeRO1`) object.
    """

    name: ClassVar[str] = "auto"
    ddp: DDP = field(default_factory=DDP)

    def __post_init__(self) -> None:
        if not isinstance(self.ddp, DDP):  # ZeRO1 is a DDP too: Auto(ddp=ZeRO1()) resolves to it
            raise ConfigError(
                f"invalid Auto option: ddp={self.ddp!r}. Auto runs DDP at world size 2 or more, "
                "so it takes a DDP(...) or ZeRO1(...) object. Pass one (Auto(ddp=DDP(...))), "
                "or pass any other strategy to wrap_model itself (strategy=FSDP())."
            )

    def resolve(self, world_size: int) -> Strategy:
        if resolved_strategy(self.name, world_size) != Single.name:
            return self.ddp
        single = Single()
        object.__setattr__(single, "_ignored", tuple(self.ddp.given()))
        return single


_BY_NAME: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (Auto, Single, DDP, DataParallel, ZeRO1, FSDP, Live)
}


def strategy_class(name: str) -> type[Strategy]:
    """The class of the strategy called ``name`` in flags and configs (``auto``, ``single``,
    ``ddp``, ``dp``, ``zero1``, ``fsdp``, ``live``).

    Raises:
        ConfigError: no strategy has that name (one line naming those that do;
            :data:`ddpkit.parallel.choices.STRATEGIES` lists those a user may pick).

    Example:
        >>> strategy_class("zero1")
        <class 'ddpkit.parallel.strategy.ZeRO1'>
    """
    if name not in _BY_NAME:
        raise ConfigError(
            f"unknown strategy: strategy={name!r}. Allowed: {', '.join(_BY_NAME)}. Use one of them."
        )
    return _BY_NAME[name]


def wrapped_strategy(model: nn.Module) -> Strategy:
    """The strategy ``model`` was wrapped with by :func:`ddpkit.wrap_model` (resolved: never
    :class:`Auto`); for a model ddpkit did not wrap, the one its wrapper class implies
    (``DistributedDataParallel``: :class:`DDP`, FSDP: :class:`FSDP`, ..., else :class:`Single`).

    Example:
        >>> wrapped_strategy(nn.Linear(2, 2))
        Single()
    """
    layer = uncompiled(model)
    known = layer.__dict__.get(_STRATEGY_ATTRIBUTE)
    if isinstance(known, Strategy):
        return known
    if is_fsdp(layer):
        return FSDP()
    if isinstance(layer, DistributedDataParallel):
        return DDP()
    return DataParallel() if isinstance(layer, nn.DataParallel) else Single()


def record_strategy(model: nn.Module, strategy: Strategy) -> None:
    """Remember that ``model`` (what :func:`ddpkit.wrap_model` returns) was wrapped with
    ``strategy``, for :func:`wrapped_strategy` (an attribute of ``model``)."""
    setattr(model, _STRATEGY_ATTRIBUTE, strategy)
