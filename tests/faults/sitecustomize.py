"""Faults the tests inject into ``ddpkit train``'s processes from outside the library.

:func:`tests.helpers.fault_env` puts this folder first on ``PYTHONPATH``, so Python imports this
module at start-up in every process of the job (the launcher, each rank: the launcher passes
its environment on) — ddpkit's code holds no test hook. Each fault wraps one library function
when its module is first imported (an import hook), before any other module takes a reference:

``DDPKIT_FAULT_INJECT=RANK:STEP``
    that rank SIGKILLs itself once it trained optimizer step STEP, before the job records or
    checkpoints the step (:func:`ddpkit.train_epoch` yields it); first attempt only (restart
    count 0): the restart tests.
``DDPKIT_TEST_SLOW_SAVE_S=S``
    every checkpoint write (and ``ddpkit train``'s start-up probe write) sleeps S seconds
    inside its temporary folder: a save long enough to signal during it.
``DDPKIT_TEST_SLOW_EVAL_S=S``
    every evaluation (:func:`ddpkit.evaluate`) waits S seconds first: a signal during it.

With none of them set this module does nothing. A wrapped function that no longer exists
fails the process at import, so a renamed function cannot silently turn a fault off.
"""

from __future__ import annotations

import functools
import importlib.abc
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

KILL_ENV = "DDPKIT_FAULT_INJECT"
SLOW_SAVE_ENV = "DDPKIT_TEST_SLOW_SAVE_S"
SLOW_EVAL_ENV = "DDPKIT_TEST_SLOW_EVAL_S"
TARGETS = {  # variable -> (module, function) the fault wraps
    KILL_ENV: ("ddpkit.training.loop", "train_epoch"),
    SLOW_SAVE_ENV: ("ddpkit.checkpoint.io", "_write_files"),
    SLOW_EVAL_ENV: ("ddpkit.training.evaluate", "evaluate"),
}

Patch = Callable[[ModuleType], None]


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs ``patches[name](module)`` right after module ``name`` is executed."""

    def __init__(self, patches: dict[str, Patch]) -> None:
        self.patches = patches

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        patch = self.patches.pop(name, None)
        if patch is None:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                break
        else:
            return None
        execute = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            patch(module)

        spec.loader.exec_module = exec_module  # this spec's own loader object
        return spec


def wrap(module: ModuleType, name: str, make: Callable[[Any], Any]) -> None:
    """Replace ``module.name`` by ``make(module.name)``; fail loudly when it is gone."""
    if not hasattr(module, name):
        raise RuntimeError(f"tests/faults: {module.__name__}.{name} is gone; update the fault")
    setattr(module, name, make(getattr(module, name)))


def kill_at(spec: str) -> Callable[[Any], Any]:
    """``RANK:STEP``: wrap ``train_epoch`` so that rank SIGKILLs itself after step STEP."""
    rank, step = (int(part) for part in spec.split(":"))

    def make(train_epoch: Any) -> Any:
        def killing(train_step: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
            results = train_epoch(train_step, *args, **kwargs)  # its checks, eagerly
            return _killing(results) if train_step.runtime.rank == rank else results

        def _killing(results: Iterator[Any]) -> Iterator[Any]:
            for result in results:
                if result.step == step:
                    os.kill(os.getpid(), signal.SIGKILL)
                yield result

        return killing

    return make


def sleeping_first(seconds: float) -> Callable[[Any], Any]:
    """Wrap a function to sleep ``seconds`` before it runs."""

    def make(function: Any) -> Any:
        def slow(*args: Any, **kwargs: Any) -> Any:
            time.sleep(seconds)
            return function(*args, **kwargs)

        return slow

    return make


def install() -> None:
    """Install the import hook for the faults set in the environment (none: nothing)."""
    makers: dict[str, Callable[[Any], Any]] = {}
    if os.environ.get(KILL_ENV) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        makers[KILL_ENV] = kill_at(os.environ[KILL_ENV])  # first attempt only
    for variable in (SLOW_SAVE_ENV, SLOW_EVAL_ENV):
        if os.environ.get(variable):
            makers[variable] = sleeping_first(float(os.environ[variable]))
    patches: dict[str, Patch] = {}
    for variable, make in makers.items():
        module_name, name = TARGETS[variable]
        patches[module_name] = functools.partial(wrap, name=name, make=make)
    if patches:
        sys.meta_path.insert(0, PatchOnImport(patches))


install()
