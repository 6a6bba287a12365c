"""The launch settings of ``ddpkit run`` and ``ddpkit train``, each declared once, without torch.

:class:`LaunchConfig` is a settings section (:mod:`ddpkit.settings`): each field carries its
flag, default, help and check. ``ddpkit run`` generates its flags from it
(:func:`ddpkit.cli.flags.add_settings_arguments`), ``ddpkit train`` composes it into its
``TrainConfig`` (the ``[launch]`` section of ``--config``), and
:func:`ddpkit.launch.spec.validate_spec` checks a :class:`~ddpkit.launch.spec.LaunchSpec`
against the same fields and :func:`launch_rules`.

Example:
    >>> from ddpkit.launch.config import LaunchConfig, launch_rules
    >>> from ddpkit.settings import field_problems
    >>> settings = LaunchConfig(nproc=2, spares=1)
    >>> field_problems(settings)  # each field's own check passed
    []
    >>> launch_rules(settings)  # the rules between fields
    ["spares=1 with fault_tolerance='restart'. Spares take over lost ranks of a live job ..."]
"""

from __future__ import annotations

from dataclasses import dataclass

from ddpkit.errors import ConfigError
from ddpkit.live.protocol import MODES
from ddpkit.runtime.signals import (
    DEFAULT_STOP_SIGNALS,
    TORCHRUN_DEFAULT_GRACE_S,
    parse_stop_signals,
)
from ddpkit.settings import at_least, finite, option

__all__ = [
    "ELASTIC_MAX_RESTARTS",
    "FAULT_TOLERANCE_MODES",
    "LIVE_MAX_RESTARTS",
    "LaunchConfig",
    "default_max_restarts",
    "launch_rules",
]

FAULT_TOLERANCE_MODES = MODES
ELASTIC_MAX_RESTARTS = 3  # elastic --nnodes MIN:MAX: one restart per node lost
LIVE_MAX_RESTARTS = 3  # --fault-tolerance live: replacement processes


def _stop_signals_rule(value: str) -> str | None:
    """The launcher's own refusal (:func:`~ddpkit.runtime.signals.parse_stop_signals`)."""
    try:
        parse_stop_signals(value)
    except ConfigError as error:
        return f"is not usable: {str(error).rstrip('.')}"
    return None


@dataclass(frozen=True)
class LaunchConfig:
    """the local processes"""

    nproc: int | None = option(
        None,
        "local processes (ranks) to start",
        check=at_least(1),
        metavar="N",
    )
    max_restarts: int = option(
        0,
        "restart all ranks up to R times after a failure; a job that saves checkpoints "
        "resumes from the newest complete one. Default %(default)s; --fault-tolerance live: R "
        f"replacement processes, default {LIVE_MAX_RESTARTS}",
        check=at_least(0),
        metavar="R",
    )
    grace_period: int = option(
        TORCHRUN_DEFAULT_GRACE_S,
        "after a stop signal, seconds every rank has to finish its step and write the "
        "checkpoint before it is killed (torchrun's --shutdown-timeout; default %(default)s)",
        check=at_least(1),
        metavar="SECONDS",
    )
    stop_signals: str = option(
        ",".join(s.name for s in DEFAULT_STOP_SIGNALS),
        "signals passed on to every rank, which stop after the same step, with a checkpoint "
        "at it, where the script uses ddpkit's runtime (default %(default)s; none = the "
        "signals' usual effect)",
        check=_stop_signals_rule,
        metavar="SIGNALS",
    )
    fault_tolerance: str = option(
        "restart",
        "restart: a failed rank stops every rank (restarted with --max-restarts from the "
        "newest checkpoint); live: the others keep training and a replacement (up to "
        "--max-restarts) heals from them (one node, strategy ddp, training through "
        "ddpkit.TrainStep; docs/fault-tolerance.md). Default %(default)s",
        choices=FAULT_TOLERANCE_MODES,
    )
    spares: int = option(
        0,
        "live: warm spare processes (torch already imported) that take over lost ranks",
        check=at_least(0),
        metavar="S",
    )
    heartbeat_timeout: float = option(
        10.0,
        "live: a rank whose heartbeat stops this long (SIGSTOP, a frozen host) is ended "
        "and its peers go on (default %(default)s)",
        check=finite(above=1),
        metavar="SECONDS",
    )


def launch_rules(settings: LaunchConfig) -> list[str]:
    """What the launch settings, each valid on its own, cannot do together (one line each)."""
    if settings.spares and settings.fault_tolerance != "live":
        return [
            f"spares={settings.spares} with fault_tolerance={settings.fault_tolerance!r}. Spares "
            "take over lost ranks of a live job only. Add --fault-tolerance live, or drop --spares"
        ]
    return []


def default_max_restarts(fault_tolerance: str, *, elastic: bool = False) -> int:
    """``max_restarts`` when none is given: :data:`LIVE_MAX_RESTARTS` replacements for a live
    job, :data:`ELASTIC_MAX_RESTARTS` for elastic membership, else 0."""
    if fault_tolerance == "live":
        return LIVE_MAX_RESTARTS
    return ELASTIC_MAX_RESTARTS if elastic else 0
