"""The MNIST job in-process: ``ddpkit train``'s ranks without the launcher, for the e2e tests
that check what the job does (losses, parameters, checkpoints, output files), not its command
line.

``train_in_process(flags, nproc)`` resolves ``flags`` as ``ddpkit train`` does (its parser, the
data, the data set's epoch count) and runs :func:`ddpkit.app.mnist.job.train_mnist` on ``nproc``
ranks forked from the test harness's forkserver (:func:`ddpkit.testing.run_distributed`), which
has imported torch already: no launcher and no rank imports torch (~7 CPU-s per 2-rank job on
2 cores, docs/performance.md). The ranks train exactly as a launched job's do (bitwise: the same
config, data, seeds and one thread each). Command-line behaviour (flags, exit statuses, the
launcher's lines, restarts, signals) stays tested through real ``ddpkit train`` processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from dataclasses import dataclass
from pathlib import Path

# A short digits job with two checkpoints (steps 4 and 8), a loss record per step: the resize
# and sharded-strategy e2e tests run it on several world sizes and strategies.
SHORT_JOB_FLAGS = [
    "--dataset",
    "digits",
    "--epochs",
    "2",
    "--max-steps",
    "8",
    "--checkpoint-every",
    "4",
    "--log-every",
    "1",
]


def step_losses(out: Path) -> dict[int, float]:
    """step -> loss, from a job's ``steps.jsonl`` in its output folder ``out``."""
    records = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


@dataclass
class InProcessRun:
    """What rank 0 of an in-process job returned."""

    summary: dict
    stdout: str  # rank 0's log lines (info), as `ddpkit train` would print them
    stderr: str  # rank 0's warnings

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def _rank(runtime, config, source) -> tuple[dict, str, str]:
    """One rank: the job with ``ddpkit train``'s logging, its output captured."""
    from ddpkit.app.mnist.job import train_mnist
    from ddpkit.log import configure_logging

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        configure_logging(runtime.info)  # its handlers write to the redirected streams
        summary = train_mnist(config, runtime, source)
    return summary, out.getvalue(), err.getvalue()


def train_in_process(
    flags: list[str], nproc: int, *, env: dict[str, str] | None = None, timeout_s: float = 240
) -> InProcessRun:
    """Train as ``ddpkit train --nproc NPROC *flags`` would (the ranks' part), in forked ranks.

    Raises:
        DistributedTestError: a rank failed (its traceback in the message).
    """
    from ddpkit.app.mnist.data import resolve_data
    from ddpkit.cli import build_parser
    from ddpkit.cli.train import resolve_config
    from ddpkit.testing import run_distributed

    args = build_parser("train").parse_args(["train", "--nproc", str(nproc), *flags])
    config, given = resolve_config(args)
    source = resolve_data(config.dataset, config.data_dir, download=False)
    epochs, source = source.with_epochs(config.epochs if "epochs" in given else None)
    directory = None if source.directory is None else str(source.directory)
    config = dataclasses.replace(  # as the launcher hands it to its ranks
        config,
        epochs=epochs,
        nproc=nproc,
        dataset=source.dataset,
        data_dir=directory,
        download=False,
    )
    results = run_distributed(
        _rank, nproc, args=(config, source), env=env, timeout_s=timeout_s, pg_timeout_s=120
    )
    return InProcessRun(*results[0])
