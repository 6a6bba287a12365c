"""State a job uses but left out of ``CheckpointManager(state=...)``: an LR scheduler, a GradScaler.

Nothing fails when they are missing: a resumed run silently restarts the schedule at its first
LR (0.029 instead of 0.0006 at step 20 of a one-cycle run) or the loss scale at its
``init_scale``. :class:`ForgottenStateCheck` names each such object in one warning line, with
the fix. How they are found:

- an optimizer an LR scheduler drives: a live scheduler (``LRScheduler`` or
  ``ReduceLROnPlateau``) whose ``optimizer`` it is (torch's own mark,
  ``optimizer.step._wrapped_by_lr_sched``, is not used: it stays after the scheduler is
  gone). The optimizers looked at are the values of ``state`` and what they hold one level
  down (a ``ZeroRedundancyOptimizer`` or
  ``PostLocalSGDOptimizer``'s ``optim``, your own object holding a dict of optimizers).
- a ``torch.amp.GradScaler`` (``torch.cuda.amp.GradScaler`` subclasses it) that is enabled and
  was used (its scale is made at its first ``scale()``), while ``state`` holds no enabled
  scaler at all. Nothing on the optimizer marks which scaler steps it, so with one in ``state``
  another live one (a GAN's second manager) is taken to belong elsewhere.

A scheduler or scaler counts as saved when it is a value of ``state`` or held one level down by
one. Live objects come from one pass over ``gc.get_objects()``: 17-35 ms (median 19-25 ms) in
a process of ~290k objects (torch, ddpkit, the MNIST CNN or a 500-layer model; 2 cores, torch
2.13.0+cpu, shared with other jobs), so the manager runs it at its first
:meth:`~ddpkit.CheckpointManager.resume` and its first save only, on rank 0. An object still
alive though nothing uses it (garbage in a reference cycle) is counted as used.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from ddpkit.log import get_logger

__all__ = ["ForgottenStateCheck", "forgotten_state", "live_objects"]

log = get_logger("checkpoint")

SCHEDULERS = (LRScheduler, ReduceLROnPlateau)  # in older torch, not an LRScheduler subclass
SCALERS = (torch.amp.GradScaler,)
MAX_NESTED = 64  # items of a container attribute looked at, one level down


def _is(obj: Any, classes: tuple[type, ...]) -> bool:
    """``isinstance`` by the type alone (it never asks ``__class__``, which lazy proxies among
    gc's objects answer with a warning or an import)."""
    return issubclass(type(obj), classes)


def _one_level(obj: Any) -> Iterator[Any]:
    """``obj``, its attributes, and the items of its small dict/list/tuple attributes."""
    yield obj
    if _is(obj, (torch.nn.Module,)):  # a model holds no optimizer; its dicts are large
        return
    for value in list(getattr(obj, "__dict__", {}).values()):
        yield value
        if _is(value, (dict, list, tuple)) and len(value) <= MAX_NESTED:
            yield from value.values() if isinstance(value, dict) else value


def _optimizers_of(obj: Any) -> list[torch.optim.Optimizer]:
    """The optimizers one state entry is or holds (a scheduler's own optimizer excluded)."""
    if _is(obj, SCHEDULERS):
        return []
    return [x for x in _one_level(obj) if _is(x, (torch.optim.Optimizer,))]


def live_objects(classes: tuple[type, ...]) -> list[Any]:
    """Every live instance of ``classes`` that gc tracks, in one pass over its objects."""
    objects = gc.get_objects()
    try:
        types = {t for t in set(map(type, objects)) if issubclass(t, classes)}
        return [o for o in objects if type(o) in types]
    finally:
        del objects


def _free_key(state: Mapping[str, Any], name: str, key: str) -> str:
    """``name`` if the state has no such key yet, else ``<key>_<name>``."""
    return name if name not in state else f"{key}_{name}"


def _scheduler_line(state: Mapping[str, Any], key: str, opt: Any, drivers: list[Any]) -> str:
    names = sorted({type(s).__name__ for s in drivers}) or ["an LR scheduler"]
    if drivers and all(_is(s, (ReduceLROnPlateau,)) for s in drivers):
        lost = "its best metric and patience count, so LR reductions come late"
    else:
        group = opt.param_groups[0]
        first = float(group.get("initial_lr", group["lr"]))
        lost = f"the schedule from its first LR ({first:g}) instead of going on from the saved step"
    return (
        f"checkpoint state has no LR scheduler: state[{key!r}] is driven by {', '.join(names)}, "
        f"which is not in CheckpointManager(state=...). A resume restarts {lost}. Add it: "
        f'state["{_free_key(state, "scheduler", key)}"] = scheduler.'
    )


def _forgotten_schedulers(
    state: Mapping[str, Any], held: list[Any], live: list[Any]
) -> dict[tuple[str, int], str]:
    """A warning line per optimizer of ``state`` that a scheduler not in ``state`` drives."""
    saved = {id(getattr(s, "optimizer", None)) for s in held if _is(s, SCHEDULERS)}
    lines: dict[tuple[str, int], str] = {}
    for key, obj in state.items():
        for opt in _optimizers_of(obj):
            if id(opt) in saved or ("scheduler", id(opt)) in lines:
                continue
            drivers = [s for s in live if getattr(s, "optimizer", None) is opt]
            if drivers:  # live ones only: torch's mark on opt.step outlives a deleted one
                lines["scheduler", id(opt)] = _scheduler_line(state, key, opt, drivers)
    return lines


def _scaler_line(state: Mapping[str, Any], scaler: Any) -> str:
    keys = [f"state[{k!r}]" for k, obj in state.items() if _optimizers_of(obj)]
    stepped = f"{' or '.join(keys)} is stepped" if keys else "the loss is scaled"
    init_scale = getattr(scaler, "_init_scale", 2.0**16)
    return (
        f"checkpoint state has no GradScaler: {stepped} through a GradScaler (loss scale now "
        f"{scaler.get_scale():g}), which is not in CheckpointManager(state=...). A resume "
        f"restarts the loss scale at {init_scale:g} (its init_scale) and its growth count at 0. "
        f'Add it: state["{_free_key(state, "scaler", "amp")}"] = scaler (a MixedPrecision\'s: '
        "precision.scaler)."
    )


def forgotten_state(state: Mapping[str, Any]) -> dict[tuple[str, int], str]:
    """``{(kind, id): warning line}`` of each LR scheduler and used GradScaler not in ``state``.

    One pass over gc's objects (see the module docstring); not a collective.
    """
    held = [x for obj in state.values() for x in _one_level(obj)]
    live = live_objects(SCHEDULERS + SCALERS)
    lines = _forgotten_schedulers(state, held, [s for s in live if _is(s, SCHEDULERS)])
    if any(_is(x, SCALERS) and x.is_enabled() for x in held):
        return lines  # this state saves its scaler: another live one is another job part's
    for scaler in (s for s in live if _is(s, SCALERS)):
        if scaler.is_enabled() and getattr(scaler, "_scale", None) is not None:
            lines["scaler", id(scaler)] = _scaler_line(state, scaler)
    return lines


class ForgottenStateCheck:
    """One manager's check: run at most once per occasion, each finding warned of once.

    Example:
        >>> check = ForgottenStateCheck()
        >>> check.run(state, "resume")  # then once more with "save"
    """

    def __init__(self) -> None:
        self.done: set[str] = set()  # the occasions checked ("resume", "save")
        self.warned: set[tuple[str, int]] = set()

    def run(self, state: Mapping[str, Any], occasion: str) -> None:
        """Warn of each scheduler or used scaler left out of ``state`` (call on rank 0 only).

        The first resume looks before anything is loaded (a scaler is not used yet); the first
        save looks again, once training used the scaler.
        """
        if occasion in self.done:
            return
        self.done.add(occasion)
        try:
            found = forgotten_state(state)
        except Exception as exc:  # noqa: BLE001 - a hint must never break a save or a resume
            log.debug("check for state left out of the checkpoint skipped: %r", exc)
            return
        for finding, line in found.items():
            if finding not in self.warned:
                self.warned.add(finding)
                log.warning(line)
