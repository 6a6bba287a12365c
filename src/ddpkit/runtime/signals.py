"""The stop signals' names and settings, without torch (the launcher's flags and help read
them before anything imports torch); :mod:`ddpkit.runtime.stop` acts on them."""

from __future__ import annotations

import signal

from ddpkit.errors import ConfigError

__all__ = [
    "DEFAULT_STOP_SIGNALS",
    "GRACE_PERIOD_ENV",
    "STOP_SIGNALS_ENV",
    "TORCHRUN_DEFAULT_GRACE_S",
    "parse_stop_signals",
]

DEFAULT_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
STOP_SIGNALS_ENV = "DDPKIT_STOP_SIGNALS"  # set by ddpkit's launcher from --stop-signals
GRACE_PERIOD_ENV = "DDPKIT_GRACE_PERIOD_S"  # set by ddpkit's launcher from --grace-period
# torchrun's --shutdown-timeout default (torch 2.13), and so ddpkit's --grace-period default
TORCHRUN_DEFAULT_GRACE_S = 30


def parse_stop_signals(text: str) -> tuple[signal.Signals, ...]:
    """``"SIGTERM,SIGUSR1"`` (or ``"TERM,USR1"``, numbers, ``"none"``) as signals.

    Raises:
        ConfigError: an unknown name, or SIGKILL/SIGSTOP (which no handler can catch).
    """
    if text.strip().lower() in ("", "none", "off"):
        return ()
    found, problems = [], []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name = part.upper() if part.upper().startswith("SIG") else f"SIG{part.upper()}"
        try:
            sig = signal.Signals(int(part)) if part.isdigit() else signal.Signals[name]
        except (KeyError, ValueError):
            problems.append(part)
            continue
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            problems.append(part)
        elif sig not in found:
            found.append(sig)
    if problems:
        raise ConfigError(
            f"invalid stop signals: {', '.join(problems)}. Use signal names such as "
            "SIGTERM,SIGINT,SIGUSR1 (SIGKILL and SIGSTOP cannot be caught), or none."
        )
    return tuple(found)
