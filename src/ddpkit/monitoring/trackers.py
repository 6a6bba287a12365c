"""Experiment trackers through their own libraries, MLflow and Weights & Biases (rank 0 only).

MLflow: ``MLFLOW_TRACKING_URI`` if set (artifacts where that store puts them: ``./mlruns`` for a
sqlite URI), else ``sqlite:///OUTPUT/mlflow.db`` with artifacts in ``OUTPUT/mlartifacts``;
experiment ``MLFLOW_EXPERIMENT_NAME`` or ``ddpkit``. A database, not
``./mlruns``: MLflow 3.x refuses the plain file store unless ``MLFLOW_ALLOW_FILE_STORE=true``
(checked with mlflow-skinny 3.18). Config as params (flattened with dots, strings cut to MLflow's
6,000 characters), metrics with ``step=``, the summary's numbers as ``summary/KEY`` metrics and
the whole summary as the artifact ``summary.json``.

W&B: ``wandb.init`` into ``OUTPUT/wandb/``, offline unless ``WANDB_MODE`` is set (``wandb sync
OUTPUT/wandb/offline-run-*`` uploads later), project ``WANDB_PROJECT`` or ``ddpkit``; silent, the
console not captured. ``wandb.setup`` gets the mode too: given to ``wandb.init`` alone, wandb
0.31 still posts its own telemetry to api.wandb.ai (seen: one POST, up to 10 s at exit offline).

Non-finite numbers never raise: metrics go as they are (MLflow's SQL store keeps NaN, stores
+-inf as +-1.8e308); in W&B's run summary and ``summary.json`` they are the strings ``"nan"``,
``"inf"``, ``"-inf"`` (W&B would turn a summary NaN into null; the JSON stays strict).

Example:
    >>> trackers = open_trackers(["mlflow"], out, run_name="a", config=cfg)
    >>> trackers.log_metrics({"train_loss": 0.41, "test_accuracy": 0.97}, step=1)
    >>> trackers.log_summary({"test_accuracy": 0.97, "wall_s": 63.2})
    >>> trackers.close()
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import numbers
import os
import re
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, cast

from ddpkit.errors import ConfigError

TRACKERS = ("mlflow", "wandb")
STATUSES = ("FINISHED", "FAILED", "KILLED")  # MLflow's end states; W&B gets exit code 0 or 1
_PARAM_VALUE_MAX = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH (2.x and 3.x)
_KEY_MAX = 250  # mlflow.utils.validation.MAX_ENTITY_KEY_LENGTH
_MLFLOW_BAD_KEY = re.compile(r"[^\w\-. :/]")  # MLflow allows these characters in names


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _plain(value: Any, strict_json: bool = False) -> Any:
    """``value`` as JSON types (other objects as ``str``); with ``strict_json`` NaN/inf as text."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v, strict_json) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, strict_json) for v in value]
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if _is_number(value):
        number = float(value)
        return str(number) if strict_json and not math.isfinite(number) else number
    return str(value)


def _flatten(tree: Mapping, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _mlflow_key(key: str) -> str:
    return _MLFLOW_BAD_KEY.sub("_", key)[:_KEY_MAX]


class _MlflowRun:
    name = "mlflow"

    def __init__(self, output_dir: Path, run_name: str, config: Mapping) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException

        # its store's set-up lines ("Creating initial MLflow database tables...") are noise in
        # a training job's output; its warnings stay
        logging.getLogger("mlflow").setLevel(logging.WARNING)
        user_uri = os.environ.get("MLFLOW_TRACKING_URI")
        self.tracking_uri = user_uri or f"sqlite:///{(output_dir / 'mlflow.db').resolve()}"
        artifacts = None if user_uri else str((output_dir / "mlartifacts").resolve())
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "ddpkit"
        self._last_step = 0
        try:
            self._client = MlflowClient(tracking_uri=self.tracking_uri)
            found = self._client.get_experiment_by_name(experiment)
            experiment_id = (
                found.experiment_id
                if found is not None
                else self._client.create_experiment(experiment, artifact_location=artifacts)
            )
            self.run_id = self._client.create_run(experiment_id, run_name=run_name).info.run_id
        except MlflowException as exc:
            raise ConfigError(
                f"cannot open the MLflow run: tracking_uri={self.tracking_uri}: {exc.message}"
            ) from None
        params = [
            Param(_mlflow_key(k), str(v)[:_PARAM_VALUE_MAX]) for k, v in _flatten(_plain(config))
        ]
        self._client.log_batch(self.run_id, params=params)  # the client splits it in batches
        self.location = f"{self.tracking_uri} (experiment {experiment}, run {self.run_id})"

    def log_metrics(self, metrics: Mapping[str, Any], step: int, prefix: str = "") -> None:
        from mlflow.entities import Metric

        self._last_step = max(self._last_step, step)
        now_ms = int(time.time() * 1000)
        batch = [
            Metric(_mlflow_key(prefix + key), float(value), now_ms, step)
            for key, value in metrics.items()
            if _is_number(value)
        ]
        if batch:
            self._client.log_batch(self.run_id, metrics=batch)

    def log_summary(self, summary: Mapping) -> None:
        self.log_metrics(dict(_flatten(summary)), self._last_step, prefix="summary/")
        self._client.log_dict(self.run_id, _plain(summary, strict_json=True), "summary.json")

    def close(self, status: str) -> None:
        self._client.set_terminated(self.run_id, status)


class _WandbRun:
    name = "wandb"

    def __init__(self, output_dir: Path, run_name: str, config: Mapping) -> None:
        import wandb

        # Any string: wandb.Settings validates it first (an unknown mode raises there, naming
        # the allowed ones); wandb.init accepts every mode Settings does.
        mode = cast(
            'Literal["online", "offline", "disabled", "shared"]',
            os.environ.get("WANDB_MODE", "offline"),
        )
        settings = wandb.Settings(console="off", silent=True)  # no capture, no banner
        # the process-wide settings decide wandb's own telemetry: offline there too (see above)
        wandb.setup(settings=wandb.Settings(mode=mode, console="off", silent=True))
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "ddpkit"),
            name=run_name,
            dir=str(output_dir),
            config=_plain(config),
            mode=mode,
            settings=settings,
        )
        self.location = str(Path(self._run.dir).parent)  # run.dir is the run's files/ folder

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        numbers_only = {k: float(v) for k, v in metrics.items() if _is_number(v)}
        # commit now: a step W&B holds back is written at finish(), after the summary, and its
        # values would then replace the summary's under the same keys
        self._run.log(numbers_only, step=step, commit=True)

    def log_summary(self, summary: Mapping) -> None:
        # strict: W&B's own encoder turns a NaN in the summary into null (measured, 0.31)
        self._run.summary.update(_plain(summary, strict_json=True))

    def close(self, status: str) -> None:
        self._run.finish(exit_code=0 if status == "FINISHED" else 1)


_OPENERS: dict[str, type[_MlflowRun | _WandbRun]] = {"mlflow": _MlflowRun, "wandb": _WandbRun}


class Trackers:
    """The open tracker runs of one job, fed together (rank 0 only; none open is a no-op).

    Use :func:`open_trackers` to build one. Also a context manager: leaving it on an exception
    closes the runs as ``FAILED``.

    Attributes:
        names: the trackers open, in the order given.
        locations: where each tracker writes, ``{name: URI or folder}`` (for one log line).
    """

    def __init__(self, runs: list[_MlflowRun | _WandbRun]) -> None:
        self._runs = list(runs)
        self.names: tuple[str, ...] = tuple(run.name for run in self._runs)
        self.locations: dict[str, str] = {run.name: run.location for run in self._runs}
        self._closed = False

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log one epoch's (or step's) numbers at ``step``; other values are left out.

        ``step`` should grow from call to call (W&B drops a step lower than one it has seen).
        NaN and inf are logged as they are.
        """
        for run in self._runs:
            run.log_metrics(metrics, step)

    def log_summary(self, summary: dict) -> None:
        """Record the job's summary: W&B's run summary; MLflow ``summary/KEY`` metrics (numbers,
        nested keys joined with dots) and the artifact ``summary.json``."""
        for run in self._runs:
            run.log_summary(summary)

    def close(self, status: str = "FINISHED") -> None:
        """End every run with ``status`` (idempotent): FINISHED, FAILED or KILLED.

        W&B gets exit code 0 for FINISHED, else 1. Every run is closed even if one fails; the
        first error is raised afterwards.

        Raises:
            ValueError: ``status`` is not one of :data:`STATUSES`.
        """
        if status not in STATUSES:
            raise ValueError(f"invalid run status: status={status!r}. Allowed: {STATUSES}.")
        if self._closed:
            return
        self._closed = True
        first: BaseException | None = None
        for run in self._runs:
            try:
                run.close(status)
            except BaseException as exc:  # close the others, then report the first failure
                first = first or exc
        if first is not None:
            raise first

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, exc_type: type | None, *rest: object) -> None:
        self.close("FINISHED" if exc_type is None else "FAILED")


def _imports(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def check_tracker_names(names: list[str]) -> list[str]:
    """The trackers asked for (deduplicated, lower case) once each library imports.

    Raises:
        ConfigError: an unknown name (the allowed ones listed); a library not installed.
    """
    wanted = list(dict.fromkeys(n.strip().lower() for n in names if n.strip()))
    unknown = [n for n in wanted if n not in TRACKERS]
    if unknown:
        raise ConfigError(
            f"unknown tracker: tracker={','.join(unknown)}. Allowed: {', '.join(TRACKERS)} "
            "(comma-separated, e.g. --tracker mlflow,wandb)."
        )
    local_mlflow = not os.environ.get("MLFLOW_TRACKING_URI")  # the sqlite store needs both
    modules = {"mlflow": ("mlflow", "sqlalchemy", "alembic") if local_mlflow else ("mlflow",)}
    missing = [n for n in wanted if not all(_imports(m) for m in modules.get(n, (n,)))]
    if missing:
        raise ConfigError(
            f"cannot open the tracker: {', '.join(missing)} is not installed. Install it with "
            f"pip install 'ddpkit[{','.join(missing)}]'."
        )
    return wanted


def open_trackers(
    names: list[str], output_dir: Path, *, run_name: str, config: Mapping
) -> Trackers:
    """Open one run per tracker named (``"mlflow"``, ``"wandb"``) and log ``config`` to it.

    Call on rank 0 only (not a collective); at world size 1 the same. An empty ``names`` gives
    a :class:`Trackers` that does nothing.

    Args:
        names: tracker names, e.g. ``["mlflow", "wandb"]``.
        output_dir: the job's output folder (created if missing); MLflow's local store and
            W&B's run folders go under it.
        run_name: the run's name in both trackers.
        config: the job's configuration (nested mappings allowed); logged once.

    Raises:
        ConfigError: an unknown name (the allowed ones listed); a tracker's library is not
            installed (the pip command given); MLflow cannot open its store or run.

    Example:
        >>> with open_trackers(["wandb"], out, run_name="r", config=cfg) as t:  # offline
        ...     t.log_metrics({"train_loss": 0.3}, step=1)
    """
    wanted = check_tracker_names(names)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    opened: list[_MlflowRun | _WandbRun] = []
    try:
        for name in wanted:
            opened.append(_OPENERS[name](output_dir, run_name, config))
    except BaseException:
        with contextlib.suppress(Exception):  # the error that stopped the opening matters
            Trackers(opened).close("FAILED")
        raise
    return Trackers(opened)
