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

With none of them set this module installs nothing. A fault can never be silently off: a
malformed or out-of-range value, a target module that is gone (checked at start-up) or a
target function that is gone (checked at import) ends the process with a message on stderr
and exit status 2 — an exception here would only be printed by :mod:`site`, and the process
would run on without the fault.

Python imports only one ``sitecustomize``; this one then runs the next one on ``sys.path``
(a system's, such as Ubuntu's apport hook), so putting this folder first hides nothing.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

KILL_ENV = "DDPKIT_FAULT_INJECT"
SLOW_SAVE_ENV = "DDPKIT_TEST_SLOW_SAVE_S"
SLOW_EVAL_ENV = "DDPKIT_TEST_SLOW_EVAL_S"
TARGETS = {  # variable -> (module, function) the fault wraps
    KILL_ENV: ("ddpkit.training.loop", "train_epoch"),
    SLOW_SAVE_ENV: ("ddpkit.checkpoint.io", "_write_files"),
    SLOW_EVAL_ENV: ("ddpkit.training.evaluate", "evaluate"),
}

Patch = Callable[[ModuleType], None]


def fail(message: str) -> NoReturn:
    """End the process loudly: ``tests/faults: message`` on stderr, exit status 2."""
    sys.stderr.write(f"tests/faults: {message}\n")
    sys.stderr.flush()
    os._exit(2)


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs ``patches[name](module)`` right after module ``name`` is executed (once).

    Being asked for a spec changes nothing: ``importlib.util.find_spec(name)`` before the
    import gets a spec whose loader patches, and the import itself gets one too. The patch
    leaves the pending list only when a loader executes the module.
    """

    def __init__(self, patches: dict[str, Patch]) -> None:
        self.patches = patches

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in self.patches:
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
            patch = self.patches.pop(name, None)
            if patch is not None:
                patch(module)

        spec.loader.exec_module = exec_module  # this spec's own loader object
        return spec


def wrap(module: ModuleType, name: str, make: Callable[[Any], Any]) -> None:
    """Replace ``module.name`` by ``make(module.name)``; fail loudly when it is gone."""
    if not hasattr(module, name):
        fail(f"{module.__name__}.{name} is gone; update TARGETS in {__file__}")
    setattr(module, name, make(getattr(module, name)))


def parse_kill(spec: str) -> tuple[int, int]:
    """``RANK:STEP`` -> ``(rank, step)``; fails loudly unless 0 <= RANK (< ``WORLD_SIZE`` where
    set) and STEP >= 1."""
    world_size = os.environ.get("WORLD_SIZE", "")
    try:
        rank, step = (int(part) for part in spec.split(":"))
    except ValueError:
        rank = step = -1
    if rank < 0 or step < 1 or (world_size.isdigit() and rank >= int(world_size)):
        bound = f" < WORLD_SIZE={world_size}" if world_size.isdigit() else ""
        fail(
            f"invalid {KILL_ENV}={spec!r}: expected RANK:STEP with 0 <= RANK{bound} and "
            "STEP >= 1, e.g. 1:10. Unset it to run without the fault."
        )
    return rank, step


def parse_seconds(variable: str) -> float:
    """The variable's value as seconds >= 0; fails loudly otherwise."""
    value = os.environ[variable]
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # also NaN
        fail(f"invalid {variable}={value!r}: expected seconds >= 0, e.g. 3. Unset it.")
    return seconds


def kill_at(rank: int, step: int) -> Callable[[Any], Any]:
    """Wrap ``train_epoch`` so that ``rank`` SIGKILLs itself after optimizer step ``step``."""

    def make(train_epoch: Any) -> Any:
        @functools.wraps(train_epoch)
        def killing(train_step: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
            results = train_epoch(train_step, *args, **kwargs)  # its checks, eagerly
            if rank >= train_step.runtime.world_size:
                fail(f"{KILL_ENV}: rank {rank} >= world size {train_step.runtime.world_size}")
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
        @functools.wraps(function)
        def slow(*args: Any, **kwargs: Any) -> Any:
            time.sleep(seconds)
            return function(*args, **kwargs)

        return slow

    return make


def module_exists(name: str) -> bool:
    """Whether module ``name`` can be found, without importing it or its parent packages (an
    import here would come before the hook, and would import torch in every process)."""
    top, *rest = name.split(".")
    spec = importlib.util.find_spec(top)  # a top-level name: imports nothing
    for depth in range(1, len(rest) + 1):
        if spec is None or spec.submodule_search_locations is None:
            return False
        child = ".".join([top, *rest[:depth]])
        spec = importlib.machinery.PathFinder.find_spec(child, spec.submodule_search_locations)
    return spec is not None


def install() -> None:
    """Install the import hook for the faults set in the environment (none: nothing)."""
    makers: dict[str, Callable[[Any], Any]] = {}
    if os.environ.get(KILL_ENV):
        kill = kill_at(*parse_kill(os.environ[KILL_ENV]))  # checked on every attempt
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            makers[KILL_ENV] = kill  # first attempt only
    for variable in (SLOW_SAVE_ENV, SLOW_EVAL_ENV):
        if os.environ.get(variable):
            makers[variable] = sleeping_first(parse_seconds(variable))
    patches: dict[str, Patch] = {}
    for variable, make in makers.items():
        module_name, name = TARGETS[variable]
        if not module_exists(module_name):
            fail(f"{variable}: module {module_name} is gone; update TARGETS in {__file__}")
        patches[module_name] = functools.partial(wrap, name=name, make=make)
    if patches:
        sys.meta_path.insert(0, PatchOnImport(patches))


def run_next_sitecustomize() -> None:
    """Run the ``sitecustomize`` this one hides: the next one on ``sys.path``, if any."""
    here = Path(__file__).resolve().parent
    entries = [Path(entry or ".").resolve() for entry in sys.path]
    if here not in entries:
        return
    later = [str(entry) for entry in entries[entries.index(here) + 1 :] if entry != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", later)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # its errors are site.py's to report, as without us


install()
if __name__ == "sitecustomize":  # not when a test loads this file under another name
    run_next_sitecustomize()
