"""The process group's settings, each declared once, without torch.

:class:`RuntimeConfig` is a settings section (:mod:`ddpkit.settings`) whose fields carry their
flag, default, help and check: ``ddpkit train`` composes it (the ``[runtime]`` section of
``--config``) and :func:`ddpkit.runtime.process_group.init_runtime` takes the same defaults and
refuses a watchdog timeout by the same rule (:func:`watchdog_timeout_rule`).

Example:
    >>> from ddpkit.runtime.config import watchdog_timeout_rule
    >>> watchdog_timeout_rule(1.5)
    'must be 0 (off) or a number of seconds >= 2 (two watchdog heartbeats)'
    >>> print(watchdog_timeout_rule(0), watchdog_timeout_rule(30))  # off; 30 s
    None None
"""

from __future__ import annotations

from dataclasses import dataclass

from ddpkit.runtime.choices import BACKENDS
from ddpkit.settings import finite, option

__all__ = [
    "INIT_TIMEOUT_S",
    "MIN_WATCHDOG_TIMEOUT_S",
    "STALL_TIMEOUT_S",
    "TRAIN_TIMEOUT_S",
    "RuntimeConfig",
    "watchdog_timeout_rule",
]

INIT_TIMEOUT_S = 300.0  # ranks waiting for each other to join
TRAIN_TIMEOUT_S = 1800.0  # one collective
STALL_TIMEOUT_S = 300.0  # the watchdog's stall report
MIN_WATCHDOG_TIMEOUT_S = 2.0  # two heartbeats of the watchdog (1 s apart)


def watchdog_timeout_rule(seconds: float) -> str | None:
    """Why ``seconds`` cannot be a watchdog timeout (stall or deadlock), else ``None``."""
    if seconds == 0 or seconds >= MIN_WATCHDOG_TIMEOUT_S:
        return None
    return (
        f"must be 0 (off) or a number of seconds >= {MIN_WATCHDOG_TIMEOUT_S:g} (two watchdog "
        "heartbeats)"
    )


@dataclass(frozen=True)
class RuntimeConfig:
    """the process group and its watchdog"""

    backend: str = option(
        "auto", "auto: nccl when each local rank has a GPU, else gloo", choices=BACKENDS
    )
    init_timeout: float = option(
        INIT_TIMEOUT_S,
        "how long ranks wait for each other to join (default %(default)s)",
        check=finite(above=0),
        metavar="SECONDS",
    )
    train_timeout: float = option(
        TRAIN_TIMEOUT_S,
        "how long one collective may wait (default %(default)s)",
        check=finite(above=0),
        metavar="SECONDS",
    )
    stall_timeout: float = option(
        STALL_TIMEOUT_S,
        "watchdog: a rank waiting in a collective longer than this while another rank "
        "runs other code ends the job with a report naming the busy rank and its Python stack; "
        "ranks stuck in collectives that cannot match end it after 5 s (default %(default)s; "
        "0 = watchdog off)",
        check=watchdog_timeout_rule,
        metavar="SECONDS",
    )
