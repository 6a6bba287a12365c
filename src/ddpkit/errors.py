"""Exception types raised by ddpkit.

Each subclasses a builtin as well, so callers can catch either the ddpkit type or the builtin one
(``except ValueError`` still catches a bad configuration). Messages follow one form:
``<what failed>: name=value. <the rule or allowed values>. <how to fix>.``
"""

from __future__ import annotations

import sys


class DdpkitError(Exception):
    """Base class of every error ddpkit raises on purpose."""


class ConfigError(DdpkitError, ValueError):
    """A user-supplied setting is invalid (bad flag, bad path, bad value)."""


class DataError(DdpkitError, ValueError):
    """A data file is missing, truncated, corrupt or of the wrong format."""


class DistributedError(DdpkitError, RuntimeError):
    """The distributed runtime is in a state that does not allow the call."""


class DiskFullError(DdpkitError, OSError):
    """A write ran out of space: the disk (or its inodes) is full (``errno`` ``ENOSPC``)."""


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, also on Python 3.10, which has no ``add_note``: there the note
    goes into ``exc.__notes__`` (read by ddpkit's own error lines; 3.10's traceback omits it).
    """
    if sys.version_info >= (3, 11):
        exc.add_note(note)
    else:  # 3.10's BaseException declares no __notes__: set it as a plain instance attribute
        exc.__dict__["__notes__"] = [*getattr(exc, "__notes__", ()), note]
