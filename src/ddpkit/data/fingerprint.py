"""Did every rank build the same dataset? A cheap fingerprint of what is stable about it.

A per-rank seed before ``random_split`` (or before shuffling a file list) gives every rank its
own train/validation split; ``len(dataset)`` still agrees, so the shards silently overlap the
held-out data. :func:`dataset_fingerprint` hashes what does not change between two correct
builds of one dataset, even one that augments at random in ``__getitem__``:

- ``length``: ``len(dataset)``;
- ``indices``: the indices of every ``Subset`` in the chain of wrappers (``random_split``'s
  output), and the sizes of every ``ConcatDataset``;
- ``targets``: a ``targets`` or ``labels`` attribute (torchvision's datasets have one; a
  property is evaluated) holding numbers, strings or tensors (other objects are left out: their
  ``repr`` may hold an address);
- ``tensors``: for a ``TensorDataset``, the shapes and dtypes of its tensors (its items are
  fixed by construction).

Each list is compared by its length and the entries at :data:`SAMPLES` (64) evenly spread
positions, so the cost does not grow with the dataset: a per-rank ``random_split`` of even a
few hundred samples differs there with near certainty; two builds that differ in one entry
between those positions are not told apart.

Items are not fetched through ``__getitem__``: it may augment at random, count what it served,
or open a file handle that DataLoader workers forked later must not inherit (h5py, LMDB). A
dataset of your own is compared by its length and its ``targets``/``labels`` attribute, so
expose one.

Cost (measured, ``python bench/data_checks.py`` and by hand): 0.1-1.3 ms per loader build
for MNIST's ``TensorDataset`` of 60,000 rows or a ``random_split`` of it on a quiet 2-core
machine, up to 8 ms with both cores busy; it does not grow with the dataset (0.03 ms for a
list of 1.28M ``targets``). Once per loader build, never per step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sized
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Dataset, IterableDataset, Subset, TensorDataset

from ddpkit.data.streams import stream_length

SAMPLES = 64  # entries of each index list, label list or tensor compared (evenly spread)
_PLAIN = (str, int, float, bool, bytes, np.generic)


def _digest(*chunks: bytes) -> str:
    h = hashlib.blake2b(digest_size=8)
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()


def _positions(length: int) -> list[int]:
    return sorted({i * length // SAMPLES for i in range(min(SAMPLES, length))})


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    """Any dtype's bytes (bfloat16 and float8 included, which numpy lacks), with its shape."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.dtype != torch.bool else flat.to(torch.uint8)
    return f"{tuple(tensor.shape)} {tensor.dtype}|".encode() + raw.numpy().tobytes()


def _sampled(values: Any) -> bytes | None:
    """Bytes that identify ``values`` (indices, labels, rows): its length and the entries at
    :data:`SAMPLES` evenly spread positions. ``None`` when an entry is not a number, a string or
    a tensor (its bytes or ``repr`` could differ between two correct processes: an address)."""
    if isinstance(values, range):
        return repr(values).encode()
    if isinstance(values, torch.Tensor):
        return f"{len(values)}|".encode() + _tensor_bytes(values[_positions(len(values))])
    if isinstance(values, np.ndarray) and values.dtype != object:
        rows = values[_positions(len(values))]
        return f"{len(values)}|".encode() + np.ascontiguousarray(rows).tobytes()
    try:
        length = len(values)
        picked = [values[p] for p in _positions(length)]
    except (TypeError, IndexError, KeyError):
        return None
    head = f"{length}|".encode()
    if all(isinstance(v, torch.Tensor) for v in picked) and picked:
        return head + b"".join(_tensor_bytes(v) for v in picked)
    if all(isinstance(v, _PLAIN) for v in picked):
        plain = [v.item() if isinstance(v, np.generic) else v for v in picked]
        return head + repr(plain).encode()
    return None


def _chain(dataset: Dataset) -> list[Dataset]:
    """``dataset`` and every dataset it wraps (``Subset.dataset``, ``ConcatDataset.datasets``)."""
    found: list[Dataset] = []
    todo = [dataset]
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
    parts: dict[str, list[bytes | None]] = {"indices": [], "targets": [], "tensors": []}
    for item in chain:
        if isinstance(item, Subset):
            parts["indices"].append(_sampled(item.indices))
        elif isinstance(item, ConcatDataset):
            parts["indices"].append(_sampled(item.cumulative_sizes))
        elif isinstance(item, TensorDataset):
            parts["tensors"] += [_sampled(tensor) for tensor in item.tensors]
        for name in ("targets", "labels"):
            value = getattr(item, name, None)
            if isinstance(value, torch.Tensor | np.ndarray | list | tuple):
                parts["targets"].append(_sampled(value))
                break
    return {
        name: _digest(*chunks)
        for name, found in parts.items()
        if (chunks := [c for c in found if c is not None])
    }


def dataset_fingerprint(dataset: Dataset) -> dict[str, str]:
    """Hashes of what is stable about ``dataset``, by the names in the module docstring.

    Not a collective; the loader builders exchange it in their settings all-gather. A stream
    (``IterableDataset``) gets ``length`` only. The keys present say what was compared.

    Returns:
        ``{"length": "60000", "tensors": "<16 hex digits>", "targets": ...}``.
    """
    if isinstance(dataset, IterableDataset):
        return {"length": str(stream_length(dataset))}
    # A map-style dataset: len() raises its own TypeError where it has no __len__.
    length = len(cast(Sized, dataset))
    return {"length": str(length), **_structure(_chain(dataset))}


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
