"""The sharded (DCP) half of :mod:`ddpkit.security.safe_load`: torch's reader and load planner
with every pickle restricted to an allow-list.

Kept apart so that importing the allow-list does not import ``torch.distributed.checkpoint``
(with DTensor and sympy, 0.6 CPU-s of every rank's start-up on the CI machine): only a process
that loads a sharded checkpoint imports this module.
"""

from __future__ import annotations

import contextlib
import io
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

from ddpkit.errors import DataError
from ddpkit.security.safe_load import dcp_metadata_class, load_state_bytes, refused

__all__ = ["SafeFileSystemReader", "SafeLoadPlanner", "refusals_unwrapped"]


@contextlib.contextmanager
def refusals_unwrapped() -> Iterator[None]:
    """Around ``dcp.load``: a refusal raised inside it (which DCP wraps in a
    ``CheckpointException`` with a traceback per rank) comes out as the one-line ``DataError``."""
    try:
        yield
    except CheckpointException as exc:
        for failure, _ in exc.failures.values():
            if isinstance(failure, DataError):
                raise failure from None
        raise


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        obj = dcp_metadata_class(module, name)
        if obj is None:
            raise refused(self.path, f"the global {module}.{name} in its DCP metadata")
        return obj


class SafeFileSystemReader(FileSystemReader):
    """torch's ``FileSystemReader`` whose ``.metadata`` is unpickled with the allow-list of
    :func:`dcp_metadata_class` (torch's own reader runs a bare ``pickle.load``).

    Raises (from ``read_metadata``):
        DataError: the metadata needs anything else (named).
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream, Path(path)).load()
        if getattr(metadata, "storage_meta", None) is None:  # as torch's own reader does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """torch's ``DefaultLoadPlanner`` whose non-tensor values load with ``weights_only=True``
    (torch's own uses ``weights_only=False``)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        data = value.getvalue() if isinstance(value, io.BytesIO) else value.read()
        loaded = load_state_bytes(data, Path(read_item.dest_index.fqn))
        if self.flatten_state_dict:  # torch's own placement, with the safe load
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
