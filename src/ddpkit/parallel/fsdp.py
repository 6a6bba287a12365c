"""``strategy="fsdp"``: torch's FSDP2 ``fully_shard`` on each block and on the root.

What :func:`wrap_fsdp` does, in torch's own terms (torchtitan's ``parallelize`` does the same
for its transformer blocks):

- every rank's trainable parameters are compared first (names, shapes, dtypes,
  ``requires_grad``; :func:`ddpkit.guards.wrapped.verify_same_parameters`): ranks that shard
  different parameter lists would exchange unrelated shards;
- ``fully_shard(block, mesh=..., reshard_after_forward=..., mp_policy=...)`` on each block the
  wrap policy picks (one parameter group each: one all-gather before its forward, one
  reduce-scatter of its gradients after its backward), then ``fully_shard(root)`` for the
  parameters left over. The mesh is the runtime's training group
  (``DeviceMesh.from_group``), so FSDP's collectives have the job's train timeout;
- the root keeps its parameters unsharded between forward and backward (torch's default for
  the root); the blocks follow ``reshard_after_forward``: ``True`` frees the gathered
  parameters after forward and gathers them again in backward (ZeRO-3), ``False`` keeps them
  until backward (ZeRO-2: more memory, one all-gather fewer per block and step);
- ``precision="bf16-mixed"`` sets ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
  reduce_dtype=torch.float32)``: parameters are gathered and computed in bfloat16, gradients
  reduce-scattered in float32 and kept, with the sharded parameters, in float32.

Default wrap policy (``wrap_policy=None``): the elements of the outermost ``nn.ModuleList`` and
``nn.Sequential`` containers that hold parameters (a transformer's ``layers``), and where the
model has none, each direct child of the root that holds parameters. A policy can also be a
module class, a tuple of classes (every module of those classes), or a callable
``policy(module) -> bool`` (called on every submodule below the root, outermost first; a module
inside one already chosen is not offered).

Where FSDP's semantics differ from DDP's, ddpkit follows them: gradient accumulation turns
FSDP's gradient sync off on the non-final micro-steps (``set_requires_gradient_sync``; the
gradients then accumulate unsharded, the reduce-scatter runs once per optimizer step);
evaluation gathers every parameter once for the whole pass (:func:`gathered_for_eval`), so
ranks with different numbers of batches never wait on each other's all-gathers.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ddpkit.errors import ConfigError
from ddpkit.guards.wrapped import verify_same_parameters
from ddpkit.parallel.choices import FSDP_PRECISION, FSDP_RESHARD_AFTER_FORWARD
from ddpkit.parallel.rules import loss_scaler_with_fsdp
from ddpkit.runtime.process_group import Runtime

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
from ddpkit.wrappers import is_fsdp, is_sharded_tensor

WrapPolicy = type | tuple[type, ...] | Callable[[nn.Module], bool] | None

# reshard_after_forward of each FSDP module ddpkit wrapped (FSDP2 has no getter), so the
# evaluation pass can put back what it changed; weak: a model dropped by the user is freed
_RESHARD_AFTER_FORWARD: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of ``tensor``: ``full_tensor()`` for a ``DTensor`` (a collective when it
    is sharded or partial, e.g. the total norm ``clip_grad_norm_`` returns), else ``tensor``."""
    return cast("DTensor", tensor).full_tensor() if is_sharded_tensor(tensor) else tensor


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """Every ``FSDPModule`` in ``model`` (the root included), outermost first."""
    return [m for m in model.modules() if is_fsdp(m)]


def _is_container(module: nn.Module) -> bool:
    return isinstance(module, (nn.ModuleList, nn.Sequential))


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _default_units(model: nn.Module) -> list[nn.Module]:
    """The elements of the outermost ModuleList/Sequential containers, else the root's
    children (those holding parameters)."""
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if _is_container(child):
                units.extend(m for m in child.children() if _has_parameters(m))
            else:
                visit(child)

    if _is_container(model):
        units = [m for m in model.children() if _has_parameters(m)]
    else:
        visit(model)
    return units or [m for m in model.children() if _has_parameters(m)]


def select_units(model: nn.Module, wrap_policy: WrapPolicy = None) -> list[nn.Module]:
    """The submodules that become their own FSDP unit (parameter group), outermost first.

    Args:
        model: the plain module (the root is never in the list: it is wrapped last, always).
        wrap_policy: ``None`` (the default policy of the module docstring), a module class or
            tuple of classes, or a callable ``policy(module) -> bool``.

    Raises:
        ConfigError: ``wrap_policy`` is none of those.
    """
    if wrap_policy is None:
        return _default_units(model)
    check_wrap_policy(wrap_policy)
    chosen = _chooser(wrap_policy)
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if chosen(child) and _has_parameters(child):
                units.append(child)
            else:
                visit(child)

    visit(model)
    return units


def _chooser(
    wrap_policy: type | tuple[type, ...] | Callable[[nn.Module], bool],
) -> Callable[[nn.Module], bool]:
    """``policy(module) -> bool`` of a checked wrap policy (classes: ``isinstance``)."""
    if isinstance(wrap_policy, (type, tuple)):
        classes = wrap_policy

        def of_classes(module: nn.Module) -> bool:
            return isinstance(module, classes)

        return of_classes
    return wrap_policy


def _is_classes(wrap_policy: object) -> bool:
    return isinstance(wrap_policy, type) or (
        isinstance(wrap_policy, tuple) and all(isinstance(c, type) for c in wrap_policy)
    )


def check_wrap_policy(wrap_policy: object) -> None:
    """Raise :class:`ConfigError` for a wrap policy that is none of those
    :func:`select_units` takes."""
    if wrap_policy is not None and not _is_classes(wrap_policy) and not callable(wrap_policy):
        raise ConfigError(
            f"invalid FSDP wrap policy: wrap_policy={wrap_policy!r}. Pass a module class, a "
            "tuple of classes, a callable policy(module) -> bool, or None (the default: each "
            "block of the model's ModuleList/Sequential)."
        )


def check_fsdp_options(wrap_policy: object, reshard_after_forward: object, precision: str) -> None:
    """Check :func:`wrap_fsdp`'s options without touching a model (what ``FSDP(...)`` runs).

    Raises:
        ConfigError: see :func:`check_wrap_policy` and :func:`mixed_precision_policy`;
            ``reshard_after_forward`` not a bool.
    """
    check_wrap_policy(wrap_policy)
    problem = loss_scaler_with_fsdp(precision, "fsdp")  # 16-mixed: the rule ddpkit train says
    if problem:
        raise ConfigError(f"{problem}.")
    if precision not in ("32", "bf16-mixed"):
        raise ConfigError(
            f"precision for strategy='fsdp': precision={precision!r}. FSDP takes 32 or "
            "bf16-mixed. Use one of them."
        )
    if not isinstance(reshard_after_forward, bool):
        raise ConfigError(
            f"invalid reshard_after_forward={reshard_after_forward!r}. It must be True (ZeRO-3: "
            "free gathered parameters after forward) or False (ZeRO-2: keep them for backward)."
        )


def mixed_precision_policy(precision: str) -> Any:
    """The ``MixedPrecisionPolicy`` of a ``--precision`` value (``32``: torch's default, fp32).

    Raises:
        ConfigError: ``16-mixed`` (FSDP2 has no sharded loss scaler; use ``bf16-mixed``) or an
            unknown value.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    check_fsdp_options(None, True, precision)
    if precision == "32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def wrap_fsdp(
    model: nn.Module,
    runtime: Runtime,
    *,
    wrap_policy: WrapPolicy = None,
    reshard_after_forward: bool = FSDP_RESHARD_AFTER_FORWARD,
    precision: str = FSDP_PRECISION,
) -> nn.Module:
    """Shard ``model`` in place with ``fully_shard`` (each unit, then the root); returns it.

    Collective: call on every rank (a parameter comparison, then FSDP's own setup). Needs a
    process group (world size 2 or more); :func:`ddpkit.wrap_model` checks that.

    Args:
        model: the plain module (moved to the runtime's device first).
        runtime: the job's :class:`~ddpkit.Runtime`; its training group is FSDP's mesh.
        wrap_policy: which submodules are units, see :func:`select_units`.
        reshard_after_forward: free each unit's gathered parameters after its forward (ZeRO-3,
            the default) or keep them until backward (ZeRO-2). The root keeps them (torch's
            default for the root, which backward needs first).
        precision: ``32`` or ``bf16-mixed`` (see :func:`mixed_precision_policy`).

    Raises:
        ConfigError: see :func:`select_units` and :func:`mixed_precision_policy`.
        WrappedModelError: the ranks' models differ in their trainable parameters.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    check_fsdp_options(wrap_policy, reshard_after_forward, precision)
    policy = mixed_precision_policy(precision)
    units = select_units(model, wrap_policy)
    model = model.to(runtime.device)
    verify_same_parameters(model, runtime)
    mesh = DeviceMesh.from_group(runtime.process_group, runtime.device.type)
    for unit in reversed(units):  # bottom-up, as fully_shard asks: inner units first
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        _RESHARD_AFTER_FORWARD[unit] = reshard_after_forward
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    _RESHARD_AFTER_FORWARD[model] = False
    return model


@contextlib.contextmanager
def gradient_sync_off(model: nn.Module) -> Iterator[None]:
    """The body's backward keeps gradients local: DDP's ``no_sync()``, FSDP's
    ``set_requires_gradient_sync(False)`` (gradients accumulate unsharded, no reduce-scatter;
    sync is switched back on when the body ends), nothing for a plain module."""
    no_sync = getattr(model, "no_sync", None)
    if no_sync is not None:
        with no_sync():
            yield
        return
    if not is_fsdp(model):
        yield
        return
    sharded = cast("FSDPModule", model)
    sharded.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        sharded.set_requires_gradient_sync(True)


@contextlib.contextmanager
def gathered_for_eval(model: nn.Module) -> Iterator[None]:
    """Inside: every FSDP unit's parameters gathered, and kept, so forwards need no collective.

    Collective: enter on every rank (one all-gather per unit); then each rank may run any
    number of forwards (evaluation shards of different lengths). On exit every unit is
    resharded and its ``reshard_after_forward`` put back. Memory: the whole model on every rank
    for the duration, as under DDP. Not a collective, and a no-op, for a module without FSDP.
    """
    modules = fsdp_modules(model)
    if not modules:
        yield
        return
    units = [cast("FSDPModule", module) for module in modules]  # the same objects, typed
    try:
        for unit in units:
            unit.unshard()
            unit.set_reshard_after_forward(False, recurse=False)
        yield
    finally:
        for module, unit in zip(modules, units, strict=True):
            unit.set_reshard_after_forward(
                _RESHARD_AFTER_FORWARD.get(module, module is not model), recurse=False
            )
            unit.reshard()
