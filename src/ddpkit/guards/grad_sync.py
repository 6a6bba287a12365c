"""The first optimizer steps' gradients compared across ranks: DDP's all-reduce really ran.

After DDP's backward every rank holds the same, all-reduced gradients, bitwise (the reduced
buckets are the same bytes everywhere; the replicas stay identical because of it). A bug that
keeps the all-reduce from running leaves each rank its own gradients; every rank then steps
on them, the replicas drift apart and the job still exits 0, its loss curve only a little worse.
That happened under ``torch.compile``: with compiled autograd, DDP's C++ reducer no-oped its
collective (fixed by pytorch/pytorch#152735, torch 2.8, which made it raise instead; 2.13 raises
"Compiled autograd is not compatible with C++ DDP Reducer"). Compiled code that bypasses DDP's
hooks can do the same. So under compile :func:`ddpkit.wrap_model` attaches a
:class:`GradSyncCheck`: before each of the first K optimizer steps (default 3) that train the
model, the gradients' exact checksums are compared across ranks; a difference raises
:class:`GradSyncError` on every rank before the step is taken, so no replica diverges.

Gradients rather than parameters: the check fires before the first update, it names the cause
(not a symptom), and it is independent of the optimizer (Adam's first step is nearly
``lr * sign(g)``, which can hide different gradients in the parameters for a step).

How it reaches every loop: torch's global optimizer step pre-hook
(``torch.optim.optimizer.register_optimizer_step_pre_hook``), so ``optimizer.step()``,
``scaler.step(optimizer)`` and :class:`ddpkit.TrainStep` are all covered. An optimizer counts
when it holds any of the model's trainable parameters; the gradients of those are compared. A
step nested in another optimizer's step (``ZeroRedundancyOptimizer``'s local optimizer) is left
to the outer one. A model under ddpkit's local SGD (gradients local by design) is not checked.
Once every check is done the hook is removed: nothing is left on later steps.

Cost: per checked step, one pass over the gradients on their device and an all-gather of
``24 * num_parameters`` bytes (``bench/compile_cost.py``); K steps per run, then nothing.
"""

from __future__ import annotations

import functools
import sys
import weakref
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ddpkit.guards.replicas import ReplicaDivergenceError, differing_from_rank_zero
from ddpkit.log import get_logger
from ddpkit.runtime.process_group import Runtime

_MAX_NAMES = 6
_CHECKS: list[GradSyncCheck] = []  # attached checks (each holds its model weakly)
_HOOK: list[Any] = []  # the one global pre-hook's handle while any check is attached
# The attribute that marks a DDP model whose gradients stay local by design (ddpkit's local SGD
# holds no_sync() open): it lives and dies with the model, no module-level registry.
_LOCAL_GRADIENTS_ATTR = "_ddpkit_gradients_local"


def mark_gradients_local(model: nn.Module) -> None:
    """Record that ``model``'s gradients are not all-reduced on purpose (local SGD): its checks
    stop comparing them. Not a collective."""
    setattr(model, _LOCAL_GRADIENTS_ATTR, True)


def gradients_local(model: nn.Module) -> bool:
    """True once :func:`mark_gradients_local` was called for ``model``."""
    return getattr(model, _LOCAL_GRADIENTS_ATTR, False) is True


class GradSyncError(ReplicaDivergenceError):
    """Gradients differ across ranks after DDP's backward: they were not all-reduced."""


class GradSyncCheck:
    """Compare the gradients of a DDP model across ranks before its first ``num_steps`` steps.

    :func:`ddpkit.wrap_model` attaches one when ``compile`` is on (``grad_sync_check_steps``,
    default 3); build one yourself around a ``DistributedDataParallel`` of your own.

    Collective: the comparison runs inside ``optimizer.step()``, which every rank calls at the
    same step (DDP's contract). A no-op at world size 1.

    Args:
        ddp_model: the ``DistributedDataParallel`` wrapper (held weakly).
        runtime: the job's :class:`~ddpkit.Runtime`.
        num_steps: K, the optimizer steps to check (>= 1).
        context: what the message says the model runs under (e.g. ``"under torch.compile"``).

    Raises (from ``optimizer.step()``, on every rank, before the parameters change):
        GradSyncError: ``gradients differ across ranks at optimizer step 1 under torch.compile:
            rank 1 differs in conv1.weight, ... The all-reduce did not run ...``.

    Example:
        >>> check = GradSyncCheck(ddp_model, runtime, num_steps=3).attach()
    """

    def __init__(
        self,
        ddp_model: DistributedDataParallel,
        runtime: Runtime,
        *,
        num_steps: int,
        context: str = "",
    ) -> None:
        self._model = weakref.ref(ddp_model)
        self.runtime = runtime
        self.num_steps = num_steps
        self.context = context
        self.num_checked = 0

    def attach(self) -> GradSyncCheck:
        """Start checking (installs torch's global step pre-hook if not yet there)."""
        if self.runtime.process_group is not None and self.num_steps > 0:
            _CHECKS.append(self)
            if not _HOOK:
                hook = register_optimizer_step_pre_hook(
                    torch.compiler.disable(_before_step)  # eager, also in a compiled step
                )
                _HOOK.append(hook)
        return self

    def detach(self) -> None:
        """Stop checking; the global hook goes once no check is left."""
        if self in _CHECKS:
            _CHECKS.remove(self)
        if not _CHECKS and _HOOK:
            _HOOK.pop().remove()

    @property
    def attached(self) -> bool:
        return self in _CHECKS

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Compare the gradients of the model's parameters that ``optimizer`` trains.

        Collective when ``optimizer`` trains the model (every rank steps it); else nothing.
        """
        model = self._model()
        if model is None or gradients_local(model):
            self.detach()  # gone, or gradients local by design (ddpkit's local SGD)
            return
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        named = [(n, p) for n, p in model.module.named_parameters() if p.requires_grad]
        named = [(n, p) for n, p in named if id(p) in held]
        if not named:
            return
        self.num_checked += 1
        if self.num_checked >= self.num_steps:
            self.detach()
        grads = [p.grad if p.grad is not None else torch.zeros(0) for _, p in named]
        differing = differing_from_rank_zero(grads, self.runtime, op="gradient sync check")
        if differing:
            self.detach()
            raise GradSyncError(self._message(differing, [n for n, _ in named]))
        if not self.attached:
            get_logger("guards").debug(
                "gradient sync check: gradients agreed on every rank for %d optimizer steps",
                self.num_checked,
            )

    def _message(self, differing: dict[int, list[int]], names: list[str]) -> str:
        parts = []
        for rank, indices in differing.items():
            shown = [names[i] for i in indices[:_MAX_NAMES]]
            more = len(indices) - len(shown)
            parts.append(
                f"rank {rank} differs in {', '.join(shown)}" + (f" and {more} more" if more else "")
            )
        where = f" {self.context}" if self.context else ""
        return (
            f"gradients differ across ranks at optimizer step {self.num_checked}{where}: "
            f"{'; '.join(parts)} (compared with rank 0). DDP's gradient all-reduce did not run, "
            "so each rank would train on its own gradients and the replicas drift apart "
            "silently (the bug class of pytorch/pytorch#152735: compiled autograd with DDP's "
            "C++ reducer skipped the collective before torch 2.8). Upgrade torch, leave "
            "compiled autograd off (or use torch._dynamo.config.optimize_ddp='python_reducer' "
            "with it), or train without compile (compile=False)."
        )


@functools.cache
def _step_wrapper_code() -> Any:
    """The code object of the wrapper torch puts around every ``Optimizer.step``."""
    return torch.optim.Optimizer.profile_hook_step(lambda *args: None).__code__


def _nested_step() -> bool:
    """True inside a step that another optimizer's step called (two step wrappers on the
    stack), e.g. ``ZeroRedundancyOptimizer``'s local optimizer."""
    code = _step_wrapper_code()
    frame: FrameType | None = sys._getframe(1)
    depth = 0
    while frame is not None:
        depth += frame.f_code is code
        frame = frame.f_back
    return depth > 1


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """torch's global optimizer step pre-hook: run every attached check."""
    if _nested_step():
        return
    for check in list(_CHECKS):
        check.before_step(optimizer)


def attach_grad_sync_check(
    model: nn.Module, runtime: Runtime, num_steps: int, *, context: str
) -> GradSyncCheck | None:
    """Attach a :class:`GradSyncCheck` to the DDP ``model`` when ``num_steps`` > 0 and there
    is a process group; return it (``None`` otherwise)."""
    if num_steps <= 0 or runtime.process_group is None:
        return None
    assert isinstance(model, DistributedDataParallel)  # only DDP strategies attach the check
    return GradSyncCheck(model, runtime, num_steps=num_steps, context=context).attach()
