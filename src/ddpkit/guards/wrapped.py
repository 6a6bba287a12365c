"""Guards for a DDP-wrapped model: the parameters DDP syncs are the ones that train.

``DistributedDataParallel`` registers its gradient all-reduce, when it is built, on the
parameters that require grad, and pairs them across ranks by position; torch's docs say never to
change the parameters after wrapping. Four ways to break that are silent in plain torch (each
rank trains on its own gradients and the job exits 0), and ddpkit catches them by default:

- ranks whose parameter lists differ at wrap time (rank 0 freezes ``a``, rank 1 freezes ``b``
  of the same shape): :func:`verify_same_parameters`, one small all-reduce before DDP is built;
- ``requires_grad`` flipped after wrapping, or a parameter or submodule assigned (a new head):
  checked in a forward pre-hook on the wrapper, so at the next step. Freezing *every* parameter
  for a while (a GAN's discriminator during the generator step) is allowed: no gradient reaches
  DDP then, so nothing is left unsynced. Flags are compared on every
  forward (one list comparison); the structure only after torch's module/parameter registration
  hooks saw an assignment inside the wrapped model;
- a backward that no forward of the wrapper preceded (``model.module(x)``,
  ``model.module.f(x)``, ``ddpkit.unwrap_model(model)(x)`` with gradients on), or a second
  backward for one forward (two ``backward`` calls; reentrant activation checkpointing of the same
  module twice): DDP all-reduces gradients only in the first backward after its forward. A
  post-accumulate-grad hook on each parameter notices a gradient that arrives when no new
  forward of the wrapper has run since that parameter's previous gradient.

Also warned about, once per process: a forward through the wrapper with grad enabled while the
model is in ``eval()`` mode (a validation loop without ``torch.no_grad()``) when that forward is
one of DDP's collectives (it broadcasts buffers, or the one-time bucket rebuild is due):
uneven evaluation shards deadlock it.

Cost when nothing is wrong: one pre-hook call and one list comparison per forward, one Python
hook call per parameter per backward (see ``bench/wrap_guard_cost.py``). Nothing is added to the
user's modules (hooks live on the wrapper and the parameter tensors, which ``copy.deepcopy`` and
pickling drop), so EMA copies and saved models carry no trace of the guard.
"""

from __future__ import annotations

import hashlib
import sys
import weakref
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules import module as torch_module
from torch.nn.parallel import DistributedDataParallel

from ddpkit.errors import DistributedError
from ddpkit.log import get_logger
from ddpkit.runtime.collectives import gather_per_rank
from ddpkit.runtime.process_group import Runtime

REWRAP = (
    "Re-wrap after changing the model: model = ddpkit.wrap_model(ddpkit.unwrap_model(model), "
    "runtime), then build the optimizer over its parameters again"
)
EVAL_FORWARD_WARNING = (
    "forward through the DDP wrapper with grad enabled in eval() mode: such a forward is a "
    "collective (DDP broadcasts buffers and rebuilds buckets in it), so on uneven evaluation "
    "shards the rank with one batch more waits forever. Evaluate under torch.no_grad(), on "
    "ddpkit.unwrap_model(model), or with ddpkit.evaluate(model, loader, rt) (training in "
    "eval() mode on purpose: ignore this)."
)
_MAX_NAMES = 8
log = get_logger("guards")


class WrappedModelError(DistributedError):
    """The wrapped model is no longer what DDP synchronises (names the parameters and the fix)."""


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMES])
    return shown + (f" and {len(names) - _MAX_NAMES} more" if len(names) > _MAX_NAMES else "")


def _describe_parameters(model: nn.Module) -> list[tuple[str, tuple[int, ...], str, bool]]:
    return [
        (name, tuple(p.shape), str(p.dtype).replace("torch.", ""), p.requires_grad)
        for name, p in model.named_parameters()
    ]


def _fingerprint(rows: list[tuple[str, tuple[int, ...], str, bool]]) -> int:
    """A 48-bit hash of the rows (exact in float64, the dtype ``gather_per_rank`` carries)."""
    digest = hashlib.blake2b(repr(rows).encode(), digest_size=6).digest()
    return int.from_bytes(digest, "big")


def verify_same_parameters(model: nn.Module, runtime: Runtime) -> None:
    """Raise on every rank unless all ranks' models have the same trainable parameters.

    Compares each parameter's name, shape, dtype and ``requires_grad`` across ranks. DDP pairs
    gradients by position among the parameters that require grad: different sets make ranks
    all-reduce unrelated gradients (silently, when the shapes happen to line up).
    :func:`ddpkit.wrap_model` calls it before building DDP.

    Collective: call on every rank (one all-reduce of ``world_size`` floats; an object
    all-gather more only when the ranks differ). A no-op at world size 1.

    Raises:
        WrappedModelError: ``model differs across ranks at wrap_model: rank 1 trains b.weight,
            ... that rank 0 does not ...``.

    Example:
        >>> verify_same_parameters(net, runtime)  # before DistributedDataParallel(net)
    """
    if runtime.process_group is None:
        return
    rows = _describe_parameters(model)
    fingerprints = gather_per_rank([_fingerprint(rows)], runtime)[:, 0].tolist()
    if len(set(fingerprints)) == 1:
        return
    gathered: list[Any] = [None] * runtime.world_size
    with runtime.watch("wrap_model parameter check"):
        dist.all_gather_object(gathered, rows, group=runtime.process_group)
    problems = [_compare_ranks(gathered[0], other, r) for r, other in enumerate(gathered)]
    raise WrappedModelError(
        f"[rank {runtime.rank}/{runtime.world_size}] model differs across ranks at wrap_model: "
        f"{'; '.join(p for p in problems if p)}. DDP pairs the trainable parameters by position, "
        "so the ranks would all-reduce unrelated gradients. Build the same model and set "
        "requires_grad the same way on every rank (freeze by name, never by rank) before "
        "wrap_model."
    )


def _compare_ranks(reference: list[Any], other: list[Any], rank: int) -> str:
    ref = {row[0]: row for row in reference}
    mine = {row[0]: row for row in other}
    parts = []
    for label, names in (
        ("trains", [n for n, row in mine.items() if row[3] and not ref.get(n, row)[3]]),
        ("freezes", [n for n, row in mine.items() if not row[3] and ref.get(n, row)[3]]),
        (
            "has shapes or dtypes differing in",
            [n for n, row in mine.items() if n in ref and row[1:3] != ref[n][1:3]],
        ),
        ("has extra parameters", [n for n in mine if n not in ref]),
        ("lacks", [n for n in ref if n not in mine]),
    ):
        if names:
            parts.append(f"{label} {_names(names)}")
    return f"rank {rank} {', '.join(parts)} (compared with rank 0)" if parts else ""


# Every module inside a guarded model -> its guard (both weakly). Torch's registration hooks are
# global, so one handle pair serves every guard; they look a module up here and mark the guard.
_GUARDED: weakref.WeakKeyDictionary[nn.Module, weakref.ref[WrapGuard]] = weakref.WeakKeyDictionary()
_REGISTRATION_HANDLES: list[Any] = []


def _on_registration(module: nn.Module, name: str, value: Any) -> None:
    ref = _GUARDED.get(module)
    guard = ref() if ref is not None else None
    if guard is not None:
        guard.structure_changed = True


def _install_registration_hooks() -> None:
    if not _REGISTRATION_HANDLES:
        _REGISTRATION_HANDLES.extend(
            [
                torch_module.register_module_module_registration_hook(_on_registration),
                torch_module.register_module_parameter_registration_hook(_on_registration),
            ]
        )


class WrapGuard:
    """Catch changes to a DDP-wrapped model, and backwards DDP does not sync, at the next step.

    :func:`ddpkit.wrap_model` attaches one to every DDP model it builds (a new ``wrap_model`` of
    the same module detaches the old one); build one yourself only around a
    ``DistributedDataParallel`` you constructed.

    Args:
        ddp_model: the ``DistributedDataParallel`` wrapper (its ``module`` is guarded).
        runtime: names the rank in messages (``[rank 1/2] ...``).

    Raises (from the wrapper's forward, or from ``backward``):
        WrappedModelError: see the module docstring for each case.

    Example:
        >>> ddp_model = DistributedDataParallel(net)  # held by you: the guard holds it weakly
        >>> guard = WrapGuard(ddp_model, runtime).attach()
    """

    def __init__(self, ddp_model: DistributedDataParallel, runtime: Runtime) -> None:
        # Only the wrapper's pre-hook holds the guard, and the guard holds the wrapper weakly:
        # the parameters' hooks (which the garbage collector does not traverse) must not keep
        # the wrapper, and through it the process group, alive.
        self._ddp_model = weakref.ref(ddp_model)
        self.module: nn.Module = ddp_model.module
        self.prefix = f"[rank {runtime.rank}/{runtime.world_size}] "
        named = list(self.module.named_parameters())
        self.names = [name for name, _ in named]
        self.params = [param for _, param in named]
        self.requires_grad = [param.requires_grad for param in self.params]
        self.structure_changed = False
        self.num_forwards = 0  # forwards of the wrapper with gradients enabled
        self._last_forward = [0] * len(self.params)  # num_forwards at each one's last gradient
        self._handles: list[Any] = []
        self._warned_eval = False

    def attach(self) -> WrapGuard:
        """Register the hooks (detaching any earlier guard of the same module); returns self."""
        module = self.module
        ref = _GUARDED.get(module)
        previous = ref() if ref is not None else None
        if previous is not None:
            previous.detach()
        _install_registration_hooks()
        ddp_model = self._ddp_model()
        assert ddp_model is not None, "attach() right after building the guard"
        self._handles.append(ddp_model.register_forward_pre_hook(self._before_forward))
        for index, param in enumerate(self.params):
            if param.requires_grad:  # a frozen one that is unfrozen fails the flag check first
                hook = param.register_post_accumulate_grad_hook(self._gradient_hook(index))
                self._handles.append(hook)
        for submodule in module.modules():
            _GUARDED[submodule] = weakref.ref(self)
        weakref.finalize(self, _remove_handles, self._handles)  # the wrapper is gone: unhook
        return self

    def detach(self) -> None:
        """Remove the hooks; the model is no longer guarded."""
        _remove_handles(self._handles)
        for submodule, ref in list(_GUARDED.items()):
            if ref() is self:
                del _GUARDED[submodule]

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if self.structure_changed:
            self._check_structure()
        flags = [param.requires_grad for param in self.params]
        if flags != self.requires_grad and any(flags):  # all frozen (a GAN's D): nothing to sync
            self._raise_flags_changed()
        if torch.is_grad_enabled():
            self.num_forwards += 1
            if not self.module.training and not self._warned_eval:
                self._warn_if_collective(module)

    def _warn_if_collective(self, ddp_model: nn.Module) -> None:
        """Warn (once) when this grad-enabled eval-mode forward is one of DDP's collectives:
        it broadcasts buffers, or its one-time bucket rebuild (after the first backward) is
        still to come. Otherwise it communicates nothing, and uneven shards are harmless."""
        buffers = getattr(ddp_model, "broadcast_buffers", False) and bool(
            getattr(ddp_model, "modules_buffers", ())
        )
        backward_ran = any(self._last_forward)
        rebuild = backward_ran and not getattr(ddp_model, "_has_rebuilt_buckets", True)
        if buffers or rebuild:
            self._warned_eval = True
            log.warning(EVAL_FORWARD_WARNING)

    def _check_structure(self) -> None:
        now = dict(self.module.named_parameters())
        known = {id(param) for param in self.params}
        current = {id(param) for param in now.values()}
        added = [name for name, param in now.items() if id(param) not in known]
        removed = [n for n, p in zip(self.names, self.params, strict=True) if id(p) not in current]
        if not added and not removed:
            self.structure_changed = False  # e.g. a module without parameters, or the same one
            return
        replaced = [name for name in added if name in removed]
        parts = [
            f"{label}: {_names(names)}"
            for label, names in (
                ("replaced (new parameter objects DDP never saw)", replaced),
                ("added", [name for name in added if name not in replaced]),
                (
                    "removed (DDP still waits for their gradients)",
                    [name for name in removed if name not in replaced],
                ),
            )
            if names
        ]
        raise WrappedModelError(
            f"{self.prefix}model changed after wrap_model: {'; '.join(parts)}. DDP all-reduces "
            "only the parameters it was built with, so new ones would train on each rank's own "
            f"gradients (the replicas drift apart). {REWRAP}."
        )

    def _raise_flags_changed(self) -> None:
        flips = zip(self.names, self.params, self.requires_grad, strict=True)
        flipped = [
            (name, param.requires_grad) for name, param, was in flips if param.requires_grad != was
        ]
        parts = []
        unfrozen = [name for name, now in flipped if now]
        frozen = [name for name, now in flipped if not now]
        if unfrozen:
            parts.append(
                f"unfrozen (never all-reduced; each rank would train them on its own "
                f"gradients): {_names(unfrozen)}"
            )
        if frozen:
            parts.append(f"frozen (DDP still waits for their gradients): {_names(frozen)}")
        raise WrappedModelError(
            f"{self.prefix}requires_grad changed after wrap_model: {'; '.join(parts)}. DDP "
            f"registers its all-reduce on the parameters that required grad when it was built. "
            f"{REWRAP}."
        )

    def _gradient_hook(self, index: int) -> Any:
        guard_ref = weakref.ref(self)  # a dead guard (its wrapper gone) leaves a no-op hook

        def hook(param: torch.Tensor) -> None:
            guard = guard_ref()
            if guard is None:
                return
            if guard._last_forward[index] == guard.num_forwards:
                guard._raise_unsynced(index)
            guard._last_forward[index] = guard.num_forwards

        return hook

    def _raise_unsynced(self, index: int) -> None:
        name = self.names[index]
        if _in_reentrant_checkpoint():
            raise WrappedModelError(
                f"{self.prefix}gradient of {name} arrived twice for one forward of the DDP "
                "wrapper, from reentrant activation checkpointing (torch.utils.checkpoint with "
                "use_reentrant=True) running the same parameters twice: DDP syncs a "
                "parameter's gradient once per backward, so the replicas drift apart. Pass "
                "use_reentrant=False to checkpoint."
            )
        raise WrappedModelError(
            f"{self.prefix}gradient of {name} computed without a new forward of the DDP "
            "wrapper: DDP all-reduces gradients only in the first backward after its own "
            "forward, so this one stays on this rank and the replicas drift apart. Either the "
            "model was called around the wrapper (model.module(x), model.module.f(x), "
            "ddpkit.unwrap_model(model)(x)) with gradients enabled: call the wrapper, model(x), "
            "moving f's work into forward (or run it under torch.no_grad() if no gradient is "
            "wanted); or backward ran twice for one forward: add the losses and call backward "
            "once."
        )


def _remove_handles(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


def _in_reentrant_checkpoint() -> bool:
    """True inside torch.utils.checkpoint's reentrant backward (called on the error path only)."""
    from torch.utils.checkpoint import CheckpointFunction

    target = CheckpointFunction.backward.__code__
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is target:
            return True
        frame = frame.f_back
    return False
