"""The wrapping's rules that tie a strategy to other settings, stated once and without torch.

The library raises them (:func:`ddpkit.wrap_model`, :mod:`ddpkit.parallel.compile`,
:func:`~ddpkit.parallel.local_sgd.enable_local_sgd`, the strategy objects); ``ddpkit train``
lists them among its config's problems before anything imports torch, so both say the same
line. Each returns the rule broken, one line without its final period, or ``None``. The world
sizes each strategy runs on are :func:`ddpkit.parallel.choices.strategy_problems`.

Example:
    >>> compile_with_strategy("ddp") is None
    True
    >>> local_sgd_with_sharding("zero1", 4)  # doctest: +ELLIPSIS
    "sync_every=4 with strategy='zero1'. Local SGD averages whole replicas, and zero1 shards ..."
"""

from __future__ import annotations

from collections.abc import Sequence

from ddpkit.parallel.choices import ONE_PROCESS

__all__ = [
    "NOT_COMPILABLE",
    "SHARDED",
    "compile_with_small_buckets",
    "compile_with_strategy",
    "ddp_options_with_fsdp",
    "ddp_options_without_ddp",
    "fsdp_options_without_fsdp",
    "live_problem",
    "local_sgd_with_comm_hook",
    "local_sgd_with_sharding",
    "local_sgd_with_static_graph",
    "loss_scaler_with_fsdp",
]

NOT_COMPILABLE = ("dp",)  # strategies torch.compile cannot work with
SHARDED = ("zero1", "fsdp")  # strategies whose ranks hold no whole replica (no local SGD)
_LIVE = ("auto", "ddp", "live")  # what live fault tolerance takes (it becomes live)
_SHARDS = {"zero1": "the optimizer state", "fsdp": "parameters, gradients and optimizer state"}


def _period(sync_every: int | None) -> str:
    return "local SGD" if sync_every is None else f"sync_every={sync_every}"


def compile_with_strategy(strategy: str) -> str | None:
    """``torch.compile`` cannot work with ``strategy`` (``dp``)."""
    if strategy not in NOT_COMPILABLE:
        return None
    return (
        f"compile=True with strategy={strategy!r}. DataParallel replicates the module onto "
        "every GPU at each forward, which torch.compile does not support. Use strategy='ddp' "
        "(what PyTorch recommends on one machine too), or drop compile (--compile)"
    )


def compile_with_small_buckets(
    bucket_cap_mb: float | None, first_bucket_mb: float = 1.0
) -> str | None:
    """DDP buckets smaller than torch.compile's DDPOptimizer's first bucket (torch asserts).

    Args:
        bucket_cap_mb: DDP's bucket size in MiB (``None``: torch's 25).
        first_bucket_mb: DDP's first bucket in MiB (torch's ``_DEFAULT_FIRST_BUCKET_BYTES``).
    """
    if bucket_cap_mb is None or bucket_cap_mb >= first_bucket_mb:
        return None
    return (
        f"compile=True with bucket_cap_mb={bucket_cap_mb:g}. torch.compile's DDPOptimizer "
        "splits the graph at DDP's buckets and needs them at least as large as its first "
        f"bucket ({first_bucket_mb:g} MiB; torch asserts otherwise). Use bucket_cap_mb >= "
        f"{first_bucket_mb:g} (--bucket-cap-mb), or drop compile"
    )


def local_sgd_with_comm_hook(sync_every: int | None, hook: str) -> str:
    """Local SGD sends no gradients, so a DDP comm hook (``hook``: what registers it, e.g.
    ``grad_compression='fp16'``) would never run. ``sync_every`` ``None``: not known here."""
    return (
        f"{_period(sync_every)} with {hook}. Local SGD sends no gradients to compress, so the "
        "comm hook would never run. Wrap the model without one (drop --grad-compression)"
    )


def local_sgd_with_static_graph(sync_every: int | None) -> str:
    """DDP's static graph fails with gradient sync held off (what local SGD does)."""
    return (
        f"{_period(sync_every)} with static_graph=True. DDP fails in static-graph mode with "
        "gradient sync off (as with no_sync, pytorch/pytorch#143580), and the static graph only "
        "speeds up the gradient sync local SGD skips. Wrap the model without it (drop "
        "--static-graph)"
    )


def local_sgd_with_sharding(strategy: str, sync_every: int | None) -> str | None:
    """Local SGD averages whole replicas, which the sharded strategies do not have."""
    if strategy not in SHARDED:
        return None
    return (
        f"{_period(sync_every)} with strategy={strategy!r}. Local SGD averages whole replicas, "
        f"and {strategy} shards {_SHARDS[strategy]}, so there is no replica to average. Use "
        "strategy='ddp' for local SGD, or drop sync_every"
    )


def live_problem(strategy: str, given: Sequence[str]) -> str | None:
    """Live fault tolerance trains plain replicas whose gradients ``TrainStep`` all-reduces:
    not another strategy, nor the options in ``given`` (``name=value`` each)."""
    named = ([] if strategy in _LIVE else [f"strategy={strategy!r}"]) + list(given)
    if not named:
        return None
    return (
        f"fault_tolerance='live' with {', '.join(named)}. Live fault tolerance trains plain "
        "data-parallel replicas whose gradients the step all-reduces (no DDP wrapper a dying "
        "peer would break). Drop them, or use fault_tolerance='restart'"
    )


def ddp_options_without_ddp(
    strategy: str, given: Sequence[str], world_size: int | None = None
) -> str | None:
    """DDP's gradient-sync options (``given``: ``name=value`` each) for a strategy of one
    process (``single``, ``dp``; ``world_size`` named when known, as for ``auto`` at world
    size 1)."""
    if not given or strategy not in ONE_PROCESS:
        return None
    at = "" if world_size is None else f" (world_size={world_size})"
    # auto ignores them at world size 1 in the library (one info line); a job that knows its
    # world size refuses them there too
    auto = " (or strategy='auto': at world_size=1 they then do nothing)" if not at else ""
    return (
        f"{', '.join(given)} with strategy={strategy!r}{at}. These configure DDP's gradient "
        f"sync, and strategy {strategy!r} has none. Drop them, or use strategy='ddp' with 2 or "
        f"more processes{auto}"
    )


def fsdp_options_without_fsdp(strategy: str, given: Sequence[str]) -> str | None:
    """FSDP's options (``given``: ``name=value`` each) for a strategy other than ``fsdp``."""
    if not given or strategy == "fsdp":
        return None
    return (
        f"{', '.join(given)} with strategy={strategy!r}. These configure FSDP's fully_shard. "
        "Use strategy='fsdp', or drop them (mixed precision for DDP is the training step's: "
        "ddpkit.MixedPrecision)"
    )


def ddp_options_with_fsdp(strategy: str, given: Sequence[str]) -> str | None:
    """DDP's gradient-sync options (``given``: ``name=value`` each) with ``fsdp``."""
    if not given or strategy != "fsdp":
        return None
    return (
        f"{', '.join(given)} with strategy='fsdp'. These configure DDP's gradient sync, and "
        "FSDP reduce-scatters gradients itself, without DDP's buckets or comm hooks. Drop them, "
        "or use strategy='ddp' or 'zero1'"
    )


def loss_scaler_with_fsdp(precision: str, strategy: str) -> str | None:
    """``16-mixed``'s loss scaler cannot step FSDP's sharded gradients."""
    if precision != "16-mixed" or strategy != "fsdp":
        return None
    return (
        "precision='16-mixed' with strategy='fsdp'. Its loss scaler does not handle sharded "
        "gradients. Use bf16-mixed (--precision bf16-mixed; in Python "
        "FSDP(precision='bf16-mixed') and MixedPrecision('bf16-mixed', runtime))"
    )
