"""Did every rank build the same dataset? A cheap fingerprint of what is stable about it.

A per-rank seed before ``random_split`` (or before shuffling a file list) gives every rank its
own train/validation split; ``len(dataset)`` still agrees, so the shards silently overlap the
held-out data. :func:`dataset_fingerprint` hashes what does not change between two correct
builds of one dataset, even one that augments at random in ``__getitem__``:

- ``length``: ``len(dataset)``;
- ``indices``: the indices of every ``Subset`` in the chain of wrappers (``random_split``'s
  output), and the sizes of every ``ConcatDataset``;
- ``targets``: a ``targets`` or ``labels`` attribute (torchvision's datasets have one);
- ``tensors``: for a ``TensorDataset``, shapes, dtypes and the rows at :data:`SAMPLES` evenly
  spread positions (its items are fixed by construction).

Items are not fetched through ``__getitem__``: it may augment at random, count what it served,
or open a file handle that DataLoader workers forked later must not inherit (h5py, LMDB). A
dataset of your own is compared by its length and its ``targets``/``labels`` attribute, so
expose one.

Cost (measured, bench/data_checks.py): well under a millisecond for MNIST's ``TensorDataset``
of 60,000 rows, once per loader build.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Dataset, IterableDataset, Subset, TensorDataset

from ddpkit.distributed.streams import stream_length

SAMPLES = 8  # rows of a TensorDataset compared (evenly spread over the dataset)


def _digest(*chunks: bytes) -> str:
    h = hashlib.blake2b(digest_size=8)
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()


def _bytes_of(values: Any) -> bytes:
    """Bytes that identify ``values`` (a tensor, an array, a sequence of numbers or strings)."""
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().contiguous().numpy().tobytes() + str(values.dtype).encode()
    if isinstance(values, np.ndarray):
        return np.ascontiguousarray(values).tobytes() + str(values.dtype).encode()
    if isinstance(values, range):
        return repr(values).encode()
    try:
        return np.asarray(values, dtype=np.int64).tobytes()
    except (TypeError, ValueError, OverflowError):
        return repr(list(values)).encode()


def _chain(dataset: Dataset) -> list[Dataset]:
    """``dataset`` and every dataset it wraps (``Subset.dataset``, ``ConcatDataset.datasets``)."""
    found, todo = [], [dataset]
    while todo and len(found) < 64:
        current = todo.pop(0)
        found.append(current)
        if isinstance(current, Subset):
            todo.append(current.dataset)
        elif isinstance(current, ConcatDataset):
            todo.extend(current.datasets)
    return found


def _structure(chain: list[Dataset]) -> dict[str, str]:
    """The ``indices``, ``targets`` and ``tensors`` entries of the fingerprint."""
    indices, targets, tensors = [], [], []
    for item in chain:
        if isinstance(item, Subset):
            indices.append(_bytes_of(item.indices))
        elif isinstance(item, ConcatDataset):
            indices.append(_bytes_of(item.cumulative_sizes))
        elif isinstance(item, TensorDataset):
            tensors.append(_tensor_rows(item.tensors))
        for name in ("targets", "labels"):
            value = getattr(item, name, None)
            if isinstance(value, torch.Tensor | np.ndarray | list | tuple):
                targets.append(_bytes_of(value))
                break
    parts = {"indices": indices, "targets": targets, "tensors": tensors}
    return {name: _digest(*chunks) for name, chunks in parts.items() if chunks}


def _tensor_rows(tensors: Sequence[torch.Tensor]) -> bytes:
    out = []
    for tensor in tensors:
        rows = _positions(len(tensor))
        out.append(f"{tuple(tensor.shape)} {tensor.dtype}".encode() + _bytes_of(tensor[rows]))
    return b"|".join(out)


def _positions(length: int) -> list[int]:
    return sorted({i * length // SAMPLES for i in range(min(SAMPLES, length))})


def dataset_fingerprint(dataset: Dataset) -> dict[str, str]:
    """Hashes of what is stable about ``dataset``, by the names in the module docstring.

    Not a collective; the loader builders exchange it in their settings all-gather. A stream
    (``IterableDataset``) gets ``length`` only. The keys present say what was compared.

    Returns:
        ``{"length": "60000", "tensors": "<16 hex digits>", "targets": ...}``.
    """
    if isinstance(dataset, IterableDataset):
        return {"length": str(stream_length(dataset))}
    return {"length": str(len(dataset)), **_structure(_chain(dataset))}


def describe(dataset: Dataset) -> str:
    """``Subset of MNIST`` style name of ``dataset``'s chain of wrappers."""
    names = [type(d).__name__ for d in _chain(dataset)[:4]]
    return " of ".join(names)


def fingerprint_mismatch(
    fingerprints: list[dict[str, str]], what: str, str_hashes_agree: bool | None
) -> str | None:
    """The one-line error for differing fingerprints (by rank), or ``None`` when they agree.

    ``what`` names the dataset (``"train dataset (Subset of TensorDataset)"``);
    ``str_hashes_agree`` (from the runtime) adds the string-hash cause when ``False``.
    """
    if len({repr(sorted(f.items())) for f in fingerprints}) <= 1:
        return None
    keys = sorted({k for f in fingerprints for k in f})
    differ = [k for k in keys if len({f.get(k) for f in fingerprints}) > 1]
    groups: dict[str, list[int]] = {}
    for rank, found in enumerate(fingerprints):
        groups.setdefault(repr([found.get(k) for k in differ]), []).append(rank)
    ranks = " | ".join("ranks " + ",".join(map(str, g)) for g in groups.values())
    causes = (
        "a per-rank seed before random_split or a shuffle of the file list (split with "
        "generator=torch.Generator().manual_seed(0), or seed per rank only after building the "
        "data)"
    )
    if str_hashes_agree is False:
        causes += (
            "; string hashes differ across ranks (PYTHONHASHSEED), so labels built from "
            "list(set(...)) differ (launch with ddpkit run, or export PYTHONHASHSEED=0)"
        )
    return (
        f"{what} differs across ranks: {', '.join(differ)} differ ({ranks} built different "
        f"data; compared: {', '.join(keys)}). Usual causes: {causes}. Build the same dataset "
        "on every rank."
    )
