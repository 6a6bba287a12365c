"""Rank-aware logging: info once (rank 0), warnings and errors from every rank with a prefix.

Only the ``ddpkit`` logger (or one you name) is configured; the root logger is left alone.

Example:
    >>> configure_logging(runtime.info)
    <Logger ddpkit (INFO)>
    >>> log = get_logger("train")                    # "ddpkit.train"
    >>> log.info("epoch 1 done")                     # on stdout, by rank 0 only
    epoch 1 done
    >>> log.warning("slow step")                     # "[rank 1/2] WARNING: slow step" on rank 1
"""

from __future__ import annotations

import logging
import sys

from ddpkit.env import ProcessInfo

_HANDLER_TAG = "_ddpkit_handler"


class RankFilter(logging.Filter):
    """Drops records below WARNING on every rank but 0 (unless ``all_ranks``)."""

    def __init__(self, info: ProcessInfo, all_ranks: bool = False) -> None:
        super().__init__()
        self.info = info
        self.all_ranks = all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        return self.all_ranks or self.info.is_rank_zero or record.levelno >= logging.WARNING


class RankFormatter(logging.Formatter):
    """Plain message for info; ``[rank r/N] LEVEL: message`` for warnings and errors.

    With ``all_ranks`` every line carries the rank prefix, so interleaved lines stay attributable.
    """

    def __init__(self, info: ProcessInfo, all_ranks: bool = False) -> None:
        super().__init__()
        self.info = info
        self.all_ranks = all_ranks

    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        if record.levelno >= logging.WARNING:
            return f"{self.info.prefix} {record.levelname}: {message}"
        if self.all_ranks and self.info.is_distributed:
            return f"{self.info.prefix} {message}"
        return message


class _StdoutBelowWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.WARNING


def configure_logging(
    info: ProcessInfo,
    *,
    level: int = logging.INFO,
    all_ranks: bool = False,
    logger_name: str = "ddpkit",
) -> logging.Logger:
    """Attach rank-aware handlers to ``logger_name``: info to stdout, warnings to stderr.

    Calling it again replaces the handlers it added before (no duplicated lines).

    Args:
        info: this process's coordinates (``runtime.info``).
        level: the logger's level.
        all_ranks: show info from every rank, each line prefixed.
        logger_name: the logger to configure; children (``ddpkit.train``) inherit it.

    Returns:
        The configured logger.
    """
    logger = logging.getLogger(logger_name)
    for handler in [h for h in logger.handlers if getattr(h, _HANDLER_TAG, False)]:
        logger.removeHandler(handler)
    out = logging.StreamHandler(sys.stdout)
    out.addFilter(_StdoutBelowWarning())
    err = logging.StreamHandler(sys.stderr)
    err.setLevel(logging.WARNING)
    for handler in (out, err):
        setattr(handler, _HANDLER_TAG, True)
        handler.addFilter(RankFilter(info, all_ranks))
        handler.setFormatter(RankFormatter(info, all_ranks))
        logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    return logger


def get_logger(name: str) -> logging.Logger:
    """``logging.getLogger("ddpkit.<name>")``: a child that uses the configured handlers."""
    return logging.getLogger(f"ddpkit.{name}")


def follow_rank_change(old: ProcessInfo, new: ProcessInfo) -> None:
    """Point the handlers :func:`configure_logging` gave ``old`` at ``new`` (live fault
    tolerance: a quorum change gives this process another rank and world size)."""
    for logger in (logging.getLogger(n) for n in ("ddpkit", *logging.root.manager.loggerDict)):
        for handler in getattr(logger, "handlers", []):
            if not getattr(handler, _HANDLER_TAG, False):
                continue
            parts = [*handler.filters, handler.formatter]
            for part in parts:
                if isinstance(part, (RankFilter, RankFormatter)) and part.info is old:
                    part.info = new
