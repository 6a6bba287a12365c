"""Small file helpers shared by ddpkit's outputs: atomic text writes and the check that a path
can be written, made before any work starts."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from ddpkit.errors import ConfigError


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename, so a
    reader sees the old file or the new one, never half of one.

    Raises:
        OSError: the file cannot be written; the temporary file is removed first.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


def json_text(payload: dict | list) -> str:
    """``payload`` as ddpkit writes JSON files: indented, a final newline, NaN/Inf refused
    (``ValueError``), so every reader gets standard JSON."""
    return json.dumps(payload, indent=2, allow_nan=False) + "\n"


def write_json_atomic(path: Path, payload: dict | list) -> None:
    """:func:`json_text` of ``payload`` written by :func:`write_text_atomic`.

    Raises:
        OSError: the file cannot be written (nothing is left behind).
        ValueError: ``payload`` holds NaN or Inf.
    """
    write_text_atomic(path, json_text(payload))


def unwritable_ancestor(folder: Path) -> tuple[Path, str] | None:
    """Why ``folder`` (existing or to be created) cannot hold new files, checked without creating
    anything: ``(nearest existing ancestor, "not a folder" | "not writable")``, or ``None``."""
    probe = Path(folder).expanduser().absolute()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        return probe, "not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return probe, "not writable"
    return None


def make_output_folder(folder: str | os.PathLike[str], flag: str = "--output-dir") -> Path:
    """Create ``folder`` (and its parents) for outputs; returns it.

    Catches what :func:`unwritable_ancestor` cannot see in advance (``/proc``, a read-only
    mount, a full disk: root passes ``os.access`` there, the ``mkdir`` still fails).

    Raises:
        ConfigError: the folder cannot be created; names ``flag`` and the OS's reason.

    Example:
        >>> make_output_folder("/proc/x")
        Traceback (most recent call last):
        ddpkit.errors.ConfigError: cannot create the output folder: --output-dir /proc/x ...
    """
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot create the output folder: {flag} {path} ({exc.strerror}: {exc.filename}). "
            f"Pass {flag} a folder you can create and write."
        ) from None
    return path
