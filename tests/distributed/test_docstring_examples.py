"""Every ``>>>`` example in src/ddpkit's docstrings runs, and every ``+SKIP`` left says why.

    .venv/bin/python -m pytest -q tests/distributed/test_docstring_examples.py

The examples are written for a reader who did ``import ddpkit`` (and ``torch``, ``nn``, ``F``)
inside a job: ``rt`` is the job's runtime, ``model`` a wrapped ``Net()``, ``loader`` its data.
Here they get exactly that. A docstring whose examples use one of the job's names
(:class:`JobContext`) runs in one 2-rank gloo job shared by all of them (each docstring with fresh
globals and its own working folder, shared by the ranks); the others run in this process, in a
temporary folder. Globals: the ddpkit public names, then the module's own, then the context's.
ELLIPSIS is on. In the job every rank runs every example, and the output shown is rank 0's (the
other ranks' examples must only not raise, or raise what they say). The docstrings in
:data:`SLOW` run with ``-m slow`` and in the whole suite, not in the inner loop.

A ``# doctest: +SKIP`` is kept only for an example that cannot run on a CPU machine with gloo
(GPUs, Slurm, network); the comment line right above the example says why, and
:func:`test_every_skip_has_a_reason` fails on one that does not.
"""

from __future__ import annotations

import ast
import builtins
import doctest
import functools
import importlib
import io
import logging
import os
import pkgutil
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.testing import run_distributed

SRC = Path(ddpkit.__file__).resolve().parent
OPTIONS = doctest.ELLIPSIS  # outputs that depend on timing or paths use "..."
WORLD_SIZE = 2


class Net(nn.Module):
    """The small model the examples call ``Net``: 4 features in, 2 classes out."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.fc1(x))))


def _dataset(num_samples: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(num_samples, 4, generator=gen),
        torch.randint(0, 2, (num_samples,), generator=gen),
    )


class JobContext:
    """The names the job examples assume, each built on first use, fresh for every docstring.

    ``rt``/``runtime``: the job's Runtime; ``Net``/``net``: a small model class and instance;
    ``model``/``ddp_model``: ``wrap_model(Net(), rt)``; ``optimizer``/``opt``: SGD over it;
    ``train_set``/``test_set``/``loader``/``x``/``y``: data; ``train_step``: a TrainStep;
    ``schedule``: an LR schedule; ``ckpt``: a CheckpointManager; ``state``: its state;
    ``step``: a step number; ``out``/``cfg``: an output folder and a config.
    """

    ALIASES = {"rt": "runtime", "ddp_model": "model", "opt": "optimizer"}

    def __init__(self, runtime: Any, folder: Path) -> None:
        self.runtime = runtime
        self.folder = folder
        self.built: dict[str, Any] = {"runtime": runtime}

    @classmethod
    def names(cls) -> set[str]:
        own = {n[len("make_") :] for n in dir(cls) if n.startswith("make_")}
        return own | set(cls.ALIASES) | {"runtime"}

    def get(self, name: str) -> Any:
        name = self.ALIASES.get(name, name)
        if name not in self.built:
            self.built[name] = getattr(self, f"make_{name}")()
        return self.built[name]

    def make_Net(self) -> type[nn.Module]:  # noqa: N802 - the name the examples use
        return Net

    def make_net(self) -> nn.Module:
        torch.manual_seed(0)
        return Net()

    def make_model(self) -> nn.Module:
        return ddpkit.wrap_model(self.get("net"), self.runtime)

    def make_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.get("model").parameters(), lr=0.1)

    def make_schedule(self) -> Any:
        return torch.optim.lr_scheduler.StepLR(self.get("optimizer"), step_size=1)

    def make_train_set(self) -> TensorDataset:
        return _dataset(32, seed=1)

    def make_test_set(self) -> TensorDataset:
        return _dataset(20, seed=2)

    def make_loader(self) -> Any:
        return ddpkit.build_train_loader(self.get("train_set"), self.runtime, batch_size=4, seed=0)

    def make_x(self) -> torch.Tensor:
        return self.get("train_set").tensors[0][:4]

    def make_y(self) -> torch.Tensor:
        return self.get("train_set").tensors[1][:4]

    def make_train_step(self) -> Any:
        return ddpkit.TrainStep(self.get("model"), self.get("optimizer"), runtime=self.runtime)

    def make_state(self) -> dict[str, Any]:
        return {"model": self.get("model"), "optimizer": self.get("optimizer")}

    def make_ckpt(self) -> Any:
        return ddpkit.CheckpointManager("ckpt", self.runtime, state=self.get("state"))

    def make_step(self) -> int:
        return 100

    def make_out(self) -> Path:
        return self.folder / "out"

    def make_cfg(self) -> dict[str, Any]:
        return {"lr": 0.1, "batch_size": 64}


JOB_NAMES = JobContext.names()
LOCAL_NAMES = {"out", "cfg"}  # what examples without a process group may assume
# Docstrings that run, but not in the inner loop (-m "not slow"), and why.
SLOW = {
    "ddpkit.monitoring.trackers": "MLflow's first SQLite store takes 10-20 s to set up",
    "ddpkit.monitoring.trackers.open_trackers": "W&B starts its service process (5-10 s)",
}


def _base_globals(module_globals: dict[str, Any]) -> dict[str, Any]:
    """The ddpkit public names and torch, then the module's own names (which win)."""
    globs: dict[str, Any] = {name: getattr(ddpkit, name) for name in ddpkit.__all__}
    globs.update(ddpkit=ddpkit, torch=torch, nn=nn, F=F, Path=Path, os=os, time=time)
    globs.update(module_globals)
    return globs


def _free_names(test: doctest.DocTest) -> set[str]:
    """Names the examples read before binding them, found neither in the module nor builtins."""
    free: set[str] = set()
    bound: set[str] = set()
    for example in test.examples:
        try:
            tree = ast.parse(example.source)
        except SyntaxError:
            continue  # doctest reports it
        loaded, stored = set(), set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                (loaded if isinstance(node.ctx, ast.Load) else stored).add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                stored.add(node.name)
            elif isinstance(node, ast.alias):
                stored.add((node.asname or node.name).split(".")[0])
        free |= loaded - bound - stored  # bound by an earlier example, or by this one
        bound |= stored
    return free - set(test.globs) - set(dir(builtins))


@functools.lru_cache(maxsize=1)
def _all_doctests() -> tuple[doctest.DocTest, ...]:
    finder = doctest.DocTestFinder(exclude_empty=True)
    tests: list[doctest.DocTest] = []
    for info in pkgutil.walk_packages(ddpkit.__path__, "ddpkit."):
        module = importlib.import_module(info.name)
        tests.extend(t for t in finder.find(module, info.name) if t.examples)
    return tuple(sorted(tests, key=lambda t: t.name))


def _needs_job(test: doctest.DocTest) -> bool:
    return bool(_free_names(test) & (JOB_NAMES - LOCAL_NAMES))


def _tests(job: bool) -> list[doctest.DocTest]:
    return [t for t in _all_doctests() if _needs_job(t) == job]


def _params(job: bool) -> list[Any]:
    return [
        pytest.param(t.name, marks=[pytest.mark.slow] if t.name in SLOW else [])
        for t in _tests(job)
    ]


class _ExceptionsOnly(doctest.OutputChecker):
    """Outputs shown are rank 0's: on the other ranks an example only has to run (and raise
    what it says it raises, if anything)."""

    def check_output(self, want: str, got: str, optionflags: int) -> bool:
        return True


def _reset_ddpkit_logger() -> None:
    """What an example's configure_logging() did is undone (as tests/conftest.py does)."""
    logger = logging.getLogger("ddpkit")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    logger.propagate = True


def _run(
    test: doctest.DocTest, context: Callable[[str], Any], *, check_output: bool = True
) -> tuple[int, str]:
    """Run one docstring's examples; returns (number failed, doctest's report)."""
    globs = _base_globals(test.globs)  # test.globs: the module's, left as found
    globs.update({n: context(n) for n in sorted(_free_names(test) & JOB_NAMES)})
    copy = doctest.DocTest(
        test.examples, globs, test.name, test.filename, test.lineno, test.docstring
    )
    report = io.StringIO()
    checker = None if check_output else _ExceptionsOnly()
    runner = doctest.DocTestRunner(checker=checker, optionflags=OPTIONS)
    try:
        result = runner.run(copy, out=report.write, clear_globs=True)
    finally:
        _reset_ddpkit_logger()
    return result.failed, report.getvalue()


def _job_rank(runtime: Any, folder: str, names: list[str]) -> list[tuple[str, int, str]]:
    """On every rank: the job's docstrings in order, each in its own folder shared by the ranks.

    Returns ``[(name, number of failed examples, doctest's report), ...]``.
    """
    by_name = {t.name: t for t in _all_doctests()}
    results = []
    for index, name in enumerate(names):
        here = Path(folder) / f"{index:02d}"
        here.mkdir(parents=True, exist_ok=True)
        os.chdir(here)
        context = JobContext(runtime, here)
        try:
            failed, report = _run(by_name[name], context.get, check_output=runtime.rank == 0)
        except Exception as exc:  # building the context failed: a test bug, shown as such
            failed, report = 1, f"building the context for {name} failed: {exc!r}"
        # in step again before the next docstring, and a failure on any rank seen by all
        ddpkit.all_gather_object(failed, runtime)
        results.append((name, failed, report))
    return results


@pytest.fixture(scope="module")
def job_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[int, str]]]:
    folder = tmp_path_factory.mktemp("docstring-job")
    names = [t.name for t in _tests(job=True)]
    per_rank = run_distributed(
        _job_rank, WORLD_SIZE, args=(str(folder), names), timeout_s=120, pg_timeout_s=30
    )
    results: dict[str, list[tuple[int, str]]] = {}
    for rank_results in per_rank:
        for name, failed, report in rank_results:
            results.setdefault(name, []).append((failed, report))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("name", _params(job=True))
def test_job_example(name: str, job_results: dict[str, list[tuple[int, str]]]) -> None:
    reports = [
        f"--- rank {rank}:\n{report}"
        for rank, (failed, report) in enumerate(job_results[name])
        if failed
    ]
    assert not reports, "\n".join(reports)


@pytest.mark.parametrize("name", _params(job=False))
def test_local_example(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for var in [v for v in os.environ if v.startswith(("MLFLOW_", "WANDB_"))]:
        monkeypatch.delenv(var)  # the trackers' examples write here, offline, never to yours
    test = next(t for t in _all_doctests() if t.name == name)
    context = JobContext(None, tmp_path)
    failed, report = _run(test, context.get)
    assert not failed, report


SKIP = re.compile(r"#\s*doctest:.*\+SKIP")


def _skips_without_reason(root: Path) -> list[str]:
    """``path:line`` of each skipped example whose line above is not a ``# reason`` comment."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines):
            if not SKIP.search(line):
                continue
            first = number  # the example's ">>>" line (the directive may sit on a "..." line)
            while first > 0 and not lines[first].lstrip().startswith(">>>"):
                first -= 1
            above = lines[first - 1].strip().removeprefix(">>>").strip() if first else ""
            if not (above.startswith("#") and len(above.split()) >= 4):
                bad.append(f"{path.relative_to(root.parent)}:{first + 1}")
    return bad


def test_every_skip_has_a_reason() -> None:
    bad = _skips_without_reason(SRC)
    assert not bad, (
        "examples skipped without a reason: "
        + ", ".join(bad)
        + ". Make the example run (tests/distributed/test_docstring_examples.py gives it `rt`, "
        "`model`, `loader`, ...), or, where it cannot run on a CPU machine with gloo (GPUs, "
        "Slurm, network), say why in a `# ...` comment line right above it."
    )


def test_the_skip_check_wants_a_comment_line_right_above(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "ok.py").write_text(
        '''"""
    >>> # needs two CUDA GPUs: DataParallel splits the batch over them
    >>> model = wrap(Net(),
    ...              rt)  # doctest: +SKIP
    """'''
    )
    (package / "bad.py").write_text('''"""
    >>> x = 1
    >>> f(x)  # doctest: +SKIP
    """''')
    assert _skips_without_reason(package) == ["pkg/bad.py:3"]
