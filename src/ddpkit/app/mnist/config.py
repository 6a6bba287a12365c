"""The settings of ``ddpkit train``: one :class:`TrainConfig` made of sections, and :func:`check`.

Every flag of ``ddpkit train`` is a field of a section, declared once with its help, default,
allowed values and (``resume=True``) whether a resumed run must keep it. The sections of what
the library configures live next to it and are composed here: the processes
(:class:`~ddpkit.launch.config.LaunchConfig`, whose flags ``ddpkit run`` has too), the process
group (:class:`~ddpkit.runtime.config.RuntimeConfig`), the wrapping
(:class:`~ddpkit.parallel.config.WrapConfig`) and the checkpoints
(:class:`~ddpkit.checkpoint.config.CheckpointConfig`); the job's own are below. The
command-line flags, the ``--config`` TOML file (one ``[section]`` per class) and the
resume-compatibility keys are all generated from these fields. :func:`check` applies every
rule that ties two fields together: the library's own (:func:`~ddpkit.launch.config.launch_rules`,
:func:`~ddpkit.checkpoint.config.checkpoint_rules`, :mod:`ddpkit.training.rules`), so the
command says what the library would, and the job's.

Example:
    >>> from ddpkit.app.mnist.config import TrainConfig, check
    >>> config = TrainConfig(epochs=2, grad_accum=4)  # flat: each section's fields are its own
    >>> check(config, world_size=2)  # a ConfigError naming every problem; none here
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ddpkit.app.mnist.choices import DATASETS, OPTIMIZERS, PROGRESS_MODES, TENSORBOARD_MODES
from ddpkit.checkpoint.config import CheckpointConfig, checkpoint_rules
from ddpkit.errors import ConfigError
from ddpkit.files import unwritable_ancestor
from ddpkit.launch.config import LaunchConfig, launch_rules
from ddpkit.monitoring.trackers import check_tracker_names
from ddpkit.parallel.choices import resolved_strategy, strategy_problems
from ddpkit.parallel.config import WrapConfig
from ddpkit.parallel.rules import (
    SHARDED,
    compile_with_small_buckets,
    compile_with_strategy,
    ddp_options_with_fsdp,
    ddp_options_without_ddp,
    fsdp_options_without_fsdp,
    live_problem,
    local_sgd_with_comm_hook,
    local_sgd_with_sharding,
    local_sgd_with_static_graph,
    loss_scaler_with_fsdp,
)
from ddpkit.runtime.config import RuntimeConfig
from ddpkit.settings import at_least, field_problems, finite, option, resume_keys
from ddpkit.training.choices import PRECISIONS
from ddpkit.training.rules import join_with_local_sgd, static_graph_with_accumulation


def _output_dir_rule(path: str) -> str | None:
    """Why ``path`` cannot be an output folder, checked without creating anything."""
    blocked = unwritable_ancestor(Path(path))
    if blocked is None:
        return None
    probe, why = blocked
    if why == "not a folder":
        return f"is not usable: {probe} is a file, not a folder"
    return f"is not writable (no write permission on {probe})"


def _straggler_window_rule(steps: int) -> str | None:
    return None if steps == 0 or steps >= 3 else "must be 0 (off) or >= 3 (optimizer steps)"


def _port_rule(port: int) -> str | None:
    return None if 0 <= port <= 65535 else "must be a TCP port 1-65535, or 0 for any free one"


def _tracker_rule(value: str) -> str | None:
    try:
        check_tracker_names(value.split(","))
    except ConfigError as error:
        return f"is not usable: {str(error).rstrip('.')}"
    return None


@dataclass(frozen=True)
class RunConfig:
    """the training run"""

    epochs: int = option(
        1,
        "passes over the data (default 1; the digits fallback: 20)",
        check=at_least(1),
        resume=True,
    )
    batch_size: int = option(
        64,
        "samples per rank per step (default %(default)s); global batch = B x world size",
        check=at_least(1),
        resume=True,
        metavar="B",
    )
    lr: float = option(
        3e-3,
        "peak learning rate of the one-cycle schedule (default %(default)s)",
        check=finite(above=0),
        resume=True,
    )
    optimizer: str = option(
        "adam", "adam, adamw or sgd (momentum 0.9)", choices=OPTIMIZERS, resume=True
    )
    seed: int = option(0, "seed of model init and data order (same on every rank)", resume=True)
    max_steps: int = option(
        0,
        "stop each epoch after S steps (0 = whole epoch); for quick checks",
        check=at_least(0),
        resume=True,
        metavar="S",
    )
    output_dir: str = option(
        "runs/mnist",
        "where outputs go (default %(default)s)",
        check=_output_dir_rule,
        metavar="DIR",
    )
    overwrite: bool = option(
        False,
        "start afresh in an OUTPUT_DIR that holds an earlier run, deleting its "
        "checkpoints and outputs (without it such a folder is refused: --resume auto continues "
        "the run)",
    )


@dataclass(frozen=True)
class DataConfig:
    """the data set"""

    dataset: str = option(
        "auto", "auto: MNIST (data dir, cache or download), else the 8x8 digits", choices=DATASETS
    )
    data_dir: str | None = option(
        None, "folder holding the four MNIST IDX files (raw or .gz)", metavar="DIR"
    )
    download: bool = option(
        True,
        "never download MNIST; use the cache or --data-dir (in --config: download = false)",
        flag="--no-download",
    )


@dataclass(frozen=True)
class StepConfig:
    """the training step"""

    grad_accum: int = option(
        1,
        "micro-batches per optimizer step (default %(default)s): the first K-1 run forward "
        "and backward without gradient sync; global batch = B x world size x K. --max-steps, "
        "--checkpoint-every and the LR schedule count optimizer steps",
        check=at_least(1),
        resume=True,
        metavar="K",
    )
    precision: str = option(
        "32",
        "32 (default), bf16-mixed (autocast to bfloat16, CPU and CUDA) or 16-mixed "
        "(float16 autocast with a loss scaler; every rank skips an overflowed step together)",
        choices=PRECISIONS,
        resume=True,
    )
    clip_grad_norm: float = option(
        0.0,
        "clip the total L2 norm of the unscaled gradients to X before each optimizer "
        "step (default 0 = off)",
        check=finite(at_least=0),
        metavar="X",
    )
    find_unused_parameters: bool = option(
        False,
        "DDP option for models whose forward skips some parameters on some steps "
        "(costs a graph traversal per step)",
    )
    static_graph: bool = option(
        False, "DDP option for models whose set of used parameters is the same every step"
    )
    join: bool = option(
        False,
        "train each epoch inside torch's Join, for ranks with different numbers of "
        "batches (the train loader is even, so this only adds Join's bookkeeping: two small "
        "all-reduces per forward)",
    )


@dataclass(frozen=True)
class GuardConfig:
    """guards across ranks"""

    on_nonfinite: str = option(
        "off",
        "NaN/Inf loss or gradient on any rank: every rank raises naming the rank and "
        "step, every rank skips that step, or no check (default; the check adds one small "
        "all-reduce, a synchronisation point, per step)",
        choices=("raise", "skip", "off"),
    )
    check_replicas_every: int = option(
        0,
        "compare parameter checksums across ranks every N steps (0 = never)",
        check=at_least(0),
        metavar="N",
    )


@dataclass(frozen=True)
class ObserveConfig:
    """watching a run"""

    progress: str = option(
        "auto",
        "rank 0's progress bar per epoch on stderr, with global samples/s and ETA: auto "
        "(default; only when stderr is a terminal), on, off",
        choices=PROGRESS_MODES,
    )
    log_every: int = option(
        50,
        "every N optimizer steps append a record to steps.jsonl and steps.csv: mean "
        "train loss over all ranks since the last record, global samples/s, learning rate "
        "(default %(default)s; 0 = none)",
        check=at_least(0),
        metavar="N",
    )
    step_timing: bool = option(
        True,
        "split each step's time into data wait, forward, backward (with DDP's overlapped "
        "all-reduce) and optimizer, in seconds per step in metrics.jsonl/csv (default "
        "%(default)s; on CUDA it synchronizes the GPU at each phase boundary)",
        on_off=True,
    )
    tensorboard: str = option(
        "auto",
        "auto (default): TensorBoard event files in OUTPUT_DIR/tensorboard when the "
        "tensorboard package is installed (pip install 'ddpkit[tensorboard]'); off",
        choices=TENSORBOARD_MODES,
    )
    straggler_window: int = option(
        20,
        "name a rank whose data loading or compute is persistently slower than the "
        "others' (one warning line; summary.json stragglers; per-rank figures in ranks.jsonl): "
        "optimizer steps per comparison window (default %(default)s; 0 = off)",
        check=_straggler_window_rule,
        metavar="N",
    )
    metrics_port: int | None = option(
        None,
        "serve every rank's step, samples/s, step-time phases, last-step time, goodput "
        "and guard events for Prometheus at http://HOST:PORT/metrics from rank 0 (0 = any free "
        "port, logged; default: no endpoint; pip install 'ddpkit[prometheus]')",
        check=_port_rule,
        metavar="PORT",
    )
    metrics_host: str = option(
        "127.0.0.1",
        "the address the metrics endpoint listens on (default %(default)s: this "
        "machine only); the one address of this machine Prometheus scrapes",
        metavar="HOST",
    )
    tracker: str = option(
        "",
        "log the config, every epoch's metrics and the summary from rank 0 to these "
        "experiment trackers: mlflow (OUTPUT_DIR/mlflow.db unless MLFLOW_TRACKING_URI is set), "
        "wandb (offline in OUTPUT_DIR/wandb unless WANDB_MODE is set); comma-separated; pip "
        "install 'ddpkit[mlflow]' / 'ddpkit[wandb]'",
        check=_tracker_rule,
        metavar="NAMES",
    )
    straggler_factor: float = option(
        1.25,
        "a rank is slow when its median data or compute time per step is at least this "
        "many times the other ranks' and costs at least a tenth of a step (default %(default)s)",
        check=finite(above=1),
        metavar="X",
    )


# ``[name]`` in a config file and one group of ``ddpkit train --help``, in this order
SECTIONS = {
    "run": RunConfig,
    "data": DataConfig,
    "launch": LaunchConfig,
    "runtime": RuntimeConfig,
    "wrap": WrapConfig,
    "step": StepConfig,
    "guards": GuardConfig,
    "checkpoint": CheckpointConfig,
    "observe": ObserveConfig,
}


@dataclass(frozen=True)
class TrainConfig(
    ObserveConfig,
    CheckpointConfig,
    GuardConfig,
    StepConfig,
    WrapConfig,
    RuntimeConfig,
    LaunchConfig,
    DataConfig,
    RunConfig,
):
    """Settings of one training job: every field of every section, read flat (``config.lr``).

    The sections (:data:`SECTIONS`) are its bases, so each field is declared once, in its
    section, with its help (``dataclasses.fields(TrainConfig)[i].metadata["option"]``).
    Construction does not validate; :func:`check` does (``train_mnist`` calls it).
    """


def resume_settings(config: TrainConfig) -> dict:
    """The settings a resumed run must share with its checkpoint (saved in the manifest): the
    fields marked ``resume=True`` (a checkpoint written before grad_accum/precision existed
    lacks them and is not refused)."""
    return {key: getattr(config, key) for key in resume_keys(TrainConfig)}


def check(config: TrainConfig, *, world_size: int | None = None) -> None:
    """Refuse a config whose values, alone or together, cannot work; one error lists them all.

    Args:
        config: the settings to check.
        world_size: the number of processes the job runs on, when known; ``None`` takes
            ``config.nproc`` and, when that is unset too, skips the rules about the strategy.

    Raises:
        ConfigError: ``invalid config: <name=value ...>. <rule>. <fix>.`` for each value out of
            its range or choices and, once every value is valid on its own, each pair that
            cannot work together (16-mixed with the non-finite guard, a static graph with
            accumulation or local SGD, local SGD with compression or Join or checks off its
            period, a strategy that does not fit the world size, DDP options without DDP or
            with fsdp, fsdp's reshard_after_forward without fsdp, local SGD with zero1). The
            rules the library checks too are its lines (:mod:`ddpkit.parallel.rules`,
            :mod:`ddpkit.parallel.choices`, :mod:`ddpkit.training.rules`, ...).

    Example:
        >>> check(TrainConfig(static_graph=True, grad_accum=2))
        Traceback (most recent call last):
            ...
        ddpkit.errors.ConfigError: invalid config: static_graph=True with grad_accum=2. ...
    """
    problems = field_problems(config)
    if not problems:  # the rules below compare values that are each valid
        size = world_size if world_size is not None else config.nproc
        rules = (
            launch_rules,
            checkpoint_rules,
            _step_rules,
            _local_sgd_rules,
            _compile_rules,
            _live_rules,
            _monitoring_rules,
        )
        problems = [p for rule in rules for p in rule(config)]
        problems += _strategy_rules(config, size) if size is not None else []
    if problems:
        raise ConfigError(f"invalid config: {'. '.join(problems)}.")


def _monitoring_rules(c: TrainConfig) -> list[str]:
    if c.metrics_port is None and c.metrics_host != "127.0.0.1":
        return [
            f"metrics_host={c.metrics_host!r} without metrics_port: there is no endpoint to "
            "listen on that address. Add --metrics-port PORT, or drop --metrics-host"
        ]
    return []


def _step_rules(c: TrainConfig) -> list[str]:
    problems = []
    if c.precision == "16-mixed" and c.on_nonfinite != "off":
        problems.append(
            f"precision='16-mixed' with on_nonfinite={c.on_nonfinite!r}. The loss scaler already "
            "skips overflowed steps on every rank and lowers the scale. Set on_nonfinite='off' "
            "(--on-nonfinite off) with 16-mixed"
        )
    static = static_graph_with_accumulation(c.static_graph, c.grad_accum, name="grad_accum")
    return problems + ([static] if static else [])


def _compile_rules(c: TrainConfig) -> list[str]:
    if not c.compile:
        if c.compile_backend != "inductor":
            return [
                f"compile_backend={c.compile_backend!r} without compile=True. The backend is "
                "used only when compiling. Add --compile, or drop --compile-backend"
            ]
        return []
    return _lines(compile_with_strategy(c.strategy), compile_with_small_buckets(c.bucket_cap_mb))


def _lines(*problems: str | None) -> list[str]:
    """The rules broken (the library's lines), without the ``None`` of those kept."""
    return [problem for problem in problems if problem]


def _local_sgd_rules(c: TrainConfig) -> list[str]:
    if c.sync_every == 1:
        return []
    hook = f"grad_compression={c.grad_compression!r}"
    problems = _lines(
        local_sgd_with_comm_hook(c.sync_every, hook) if c.grad_compression != "none" else None,
        local_sgd_with_static_graph(c.sync_every) if c.static_graph else None,
        join_with_local_sgd(c.join, c.sync_every),
        local_sgd_with_sharding(c.strategy, c.sync_every),
    )
    for name in ("check_replicas_every", "checkpoint_every"):
        if getattr(c, name) % c.sync_every:
            problems.append(
                f"{name}={getattr(c, name)} with sync_every={c.sync_every}. It must be a "
                "multiple of sync_every (replicas agree only right after averaging). Use a "
                f"multiple of {c.sync_every}"
            )
    return problems


def _live_rules(c: TrainConfig) -> list[str]:
    """Live fault tolerance trains plain data-parallel replicas (gradients all-reduced by the
    step, not DDP): what it does not take."""
    if c.fault_tolerance != "live":
        return []
    given = {
        "grad_compression": c.grad_compression != "none",
        "sync_every": c.sync_every > 1,
        "sync_batchnorm": c.sync_batchnorm,
        "bucket_cap_mb": c.bucket_cap_mb is not None,
        "grad_as_bucket_view": c.grad_as_bucket_view,
        "find_unused_parameters": c.find_unused_parameters,
        "static_graph": c.static_graph,
        "compile": c.compile,
        "join": c.join,
        "async_checkpoint": c.async_checkpoint,
        "precision": c.precision == "16-mixed",
    }
    return _lines(live_problem(c.strategy, _named(c, given)))


def _named(c: TrainConfig, given: dict[str, bool]) -> list[str]:
    """``name=value`` of each field whose flag in ``given`` is on."""
    return [f"{name}={getattr(c, name)!r}" for name, on in given.items() if on]


def _strategy_rules(c: TrainConfig, world_size: int) -> list[str]:
    problems = strategy_problems(c.strategy, world_size)
    if problems:
        return problems
    strategy = resolved_strategy(c.strategy, world_size)
    ddp_only = {
        "bucket_cap_mb": c.bucket_cap_mb is not None,
        "grad_as_bucket_view": c.grad_as_bucket_view,
        "grad_compression": c.grad_compression != "none",
        "sync_every": c.sync_every > 1,
        "sync_batchnorm": c.sync_batchnorm,
    }
    given = _named(c, ddp_only)
    return _sharded_rules(c, strategy) + _lines(
        ddp_options_without_ddp(strategy, given, world_size)
    )


def _sharded_rules(c: TrainConfig, strategy: str) -> list[str]:
    """What the sharded strategies do not take (ddp's own options, 16-mixed), and what only
    they take (asynchronous checkpoints, fsdp's resharding)."""
    problems = []
    if c.async_checkpoint and strategy not in SHARDED:
        problems.append(
            f"async_checkpoint=True with strategy={strategy!r}. Only sharded checkpoints "
            "(fsdp, zero1) are written in the background. Use one of them, or drop "
            "--async-checkpoint"
        )
    reshard = [] if c.reshard_after_forward else ["reshard_after_forward=False"]
    not_fsdp = {
        "bucket_cap_mb": c.bucket_cap_mb is not None,
        "grad_as_bucket_view": c.grad_as_bucket_view,
        "grad_compression": c.grad_compression != "none",
        "find_unused_parameters": c.find_unused_parameters,
        "static_graph": c.static_graph,
        "join": c.join,  # Join drives DDP's join hooks (join_uneven_inputs needs DDP)
    }
    return problems + _lines(
        fsdp_options_without_fsdp(strategy, reshard),
        ddp_options_with_fsdp(strategy, _named(c, not_fsdp)),
        loss_scaler_with_fsdp(c.precision, strategy),
    )
