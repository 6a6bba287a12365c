"""Data-loading randomness: one shared shuffle, different augmentation draws per rank and worker.

The shuffle order must be the same on every rank (``DistributedSampler`` splits one permutation),
but augmentation drawn inside ``Dataset.__getitem__`` (torch, numpy, python ``random``) must
differ across ranks and workers, or every rank trains on the same "random" crops. Both come
from the user's one ``seed``:

- DataLoader workers: torch seeds worker ``w`` from the loader's ``generator`` (``base_seed +
  w`` for torch and ``random``, a mix of both for numpy). :func:`worker_base_seed` gives that
  generator a seed drawn from ``(seed, rank, epoch)`` before each pass, so every (rank, worker,
  epoch) gets its own stream, the same again on a rerun or a resume.
- Main-process loading (``num_workers=0``): ``__getitem__`` draws from the process's global
  RNGs, which users seed identically on every rank (model initialisation must agree). Each batch
  is fetched inside :func:`main_process_data_rng` with a seed drawn from ``(seed, rank, epoch,
  batch)``; the global RNG states are restored afterwards, so data loading never shifts the
  training stream (dropout) and a resumed pass draws the same augmentation bitwise.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
from collections.abc import Iterator
from typing import Any, TypeAlias

import numpy as np
import torch
from numpy.random import mtrand
from numpy.typing import NDArray

# What the legacy global numpy generator is put back from: its bit generator (numpy >= 1.25) or
# its state as ``np.random.get_state()`` returns it.
_NumpySaved: TypeAlias = (
    "np.random.BitGenerator | dict[str, Any] | tuple[str, NDArray[np.uint32], int, int, float]"
)


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts`` (ints and short strings): stable across runs and machines.

    Unlike ``seed + rank``, nearby inputs give unrelated seeds, so torch's per-worker
    ``base_seed + worker_id`` of one rank never equals another rank's.

    Example:
        >>> derive_seed("workers", 0, 1, 3) == derive_seed("workers", 0, 1, 3)
        True
    """
    data = ",".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def worker_base_seed(seed: int, rank: int, epoch: int) -> int:
    """The seed of the loader generator torch draws its workers' ``base_seed`` from."""
    return derive_seed("workers", seed, rank, epoch)


def main_process_batch_seed(seed: int, rank: int, epoch: int, batch_index: int) -> int:
    """The seed of batch ``batch_index`` (from the pass start) fetched in the main process."""
    return derive_seed("main", seed, rank, epoch, batch_index)


@contextlib.contextmanager
def main_process_data_rng(seed: int) -> Iterator[None]:
    """Seed torch's CPU RNG, numpy's global RNG and ``random`` from ``seed``; restore them after.

    About 30 us. numpy's global ``RandomState`` gets a fresh ``PCG64(seed)`` bit generator for
    the duration (swapped in and out, never copied: copying its state costs 100 us). CUDA RNGs
    are left alone (torch's own ``manual_seed`` would reseed them too).
    """
    saved_torch, saved_random = torch.get_rng_state(), random.getstate()
    saved_numpy = _swap_numpy(np.random.PCG64(seed))
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    try:
        yield
    finally:
        torch.set_rng_state(saved_torch)
        random.setstate(saved_random)
        _restore_numpy(saved_numpy)


def _swap_numpy(bit_generator: np.random.BitGenerator) -> _NumpySaved:
    # mtrand: numpy.random's stubs leave (get|set)_bit_generator out of its __all__.
    if hasattr(mtrand, "set_bit_generator"):  # numpy >= 1.25
        saved = mtrand.get_bit_generator()
        mtrand.set_bit_generator(bit_generator)
        return saved
    saved_state = np.random.get_state()
    np.random.seed(bit_generator.random_raw() & 0xFFFFFFFF)
    return saved_state


def _restore_numpy(saved: _NumpySaved) -> None:
    if isinstance(saved, np.random.BitGenerator):
        mtrand.set_bit_generator(saved)
    else:
        np.random.set_state(saved)
