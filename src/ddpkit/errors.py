"""Exception types raised by ddpkit.

Each subclasses a builtin as well, so callers can catch either the ddpkit type or the builtin one
(``except ValueError`` still catches a bad configuration). Messages follow one form:
``<what failed>: name=value. <the rule or allowed values>. <how to fix>.``
"""

from __future__ import annotations


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
