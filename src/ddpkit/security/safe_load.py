"""Loading a checkpoint runs no code: every pickle ddpkit reads is restricted to an allow-list.

A checkpoint folder is data anyone with write access to it can change, and its SHA-256 manifest
can be rewritten along with it, so the checksums catch corruption, not an attacker. What could
run code is unpickling, in three places, each restricted here:

- ``state.pt`` (the replicated state): ``torch.load(weights_only=True)`` with
  :data:`SAFE_GLOBALS` allowed on top of torch's own list (the numpy types of RNG states);
- ``dcp/.metadata`` of a sharded checkpoint, which torch's ``FileSystemReader`` reads with a
  bare ``pickle.load``: :class:`ddpkit.security.safe_dcp.SafeFileSystemReader` reads it with an
  unpickler that resolves only the classes torch's DCP metadata is made of
  (:func:`dcp_metadata_class`);
- non-tensor values inside the DCP shards (an optimizer's ``lr``), which torch's
  ``DefaultLoadPlanner.load_bytes`` reads with ``torch.load(weights_only=False)``:
  :class:`ddpkit.security.safe_dcp.SafeLoadPlanner` reads them with ``weights_only=True``.

The DCP readers live in :mod:`ddpkit.security.safe_dcp`, so that a process that loads no sharded
checkpoint never imports ``torch.distributed.checkpoint`` (0.6 s of a rank's start-up here).

A state that needs other classes (an object of your own returned by a ``state_dict()``) is
refused in one line naming the class. Allow it with ``torch.serialization.add_safe_globals
([YourClass])``, or, for a checkpoint you wrote yourself and trust, load it with
``unsafe_pickle=True`` (``CheckpointManager(..., unsafe_pickle=True)``, ``ddpkit train
--unsafe-pickle``, ``ddpkit checkpoint export --unsafe-pickle``), which unpickles anything and
so runs whatever the file says.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ddpkit.errors import DataError

__all__ = ["SAFE_GLOBALS", "dcp_metadata_class", "load_state_bytes", "refused"]


def _numpy_globals() -> list[Any]:
    """What numpy arrays and dtypes unpickle through (RNG states hold them): ``_reconstruct``
    under numpy 1's and 2's module names, ``ndarray``, ``dtype`` and the common dtype classes."""
    found: list[Any] = [np.ndarray, np.dtype]
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):
        with contextlib.suppress(ImportError, AttributeError):
            found.append(__import__(module, fromlist=["_reconstruct"])._reconstruct)
            break
    kinds = (np.uint8, np.uint32, np.int32, np.int64, np.float32, np.float64, np.bool_)
    found += [type(np.dtype(kind)) for kind in kinds]
    return found


SAFE_GLOBALS: list[Any] = _numpy_globals()  # on top of torch's weights_only defaults
UNSAFE_HINT = (
    "Loading it would run that code. If the class is yours, allow it with "
    "torch.serialization.add_safe_globals([TheClass]); only for a checkpoint you wrote and "
    "trust, load with unsafe_pickle=True (ddpkit train/checkpoint export --unsafe-pickle)"
)


def refused(path: Path, detail: str) -> DataError:
    return DataError(
        f"unsafe checkpoint: path={path} holds {detail}, which is not on the allow-list of "
        f"what a checkpoint may contain (tensors, numbers, strings, containers, numpy arrays). "
        f"{UNSAFE_HINT}."
    )


def _global_named(message: str) -> str:
    found = re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) (\S+)", message)
    if found:
        return f"the global {found.group(1)}"
    found = re.search(r"WeightsUnpickler error: ([^\n]*?)(?:\.\s|$)", message)
    return found.group(1) if found else "an object torch's weights_only loader refuses"


def load_state_bytes(data: bytes, path: Path, *, unsafe_pickle: bool = False) -> Any:
    """Unpickle ``state.pt``'s bytes on CPU, allowing only safe types unless ``unsafe_pickle``.

    Raises:
        DataError: the file needs a class or function outside the allow-list (named).
    """
    if unsafe_pickle:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise refused(path, _global_named(str(exc))) from None


_DCP_MODULES = ("torch.distributed.checkpoint.metadata",)
_DCP_EXTRA = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


def dcp_metadata_class(module: str, name: str) -> Any:
    """The object ``module.name`` if DCP metadata may use it, else ``None``: the classes of
    ``torch.distributed.checkpoint.metadata`` (dataclasses and enums), the filesystem's
    ``_StorageInfo``, ``torch.Size``, torch dtypes, layouts and memory formats, paths."""
    if module in _DCP_MODULES or (module, name) in _DCP_EXTRA:
        obj = getattr(__import__(module, fromlist=[name]), name, None)
        return obj if isinstance(obj, type) or (module, name) in _DCP_EXTRA else None
    if module == "torch":
        obj = getattr(torch, name, None)
        if isinstance(obj, torch.dtype | torch.layout | torch.memory_format):
            return obj
    return None
