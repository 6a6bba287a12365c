"""MNIST for the main job: IDX files, SHA-256 verification, download with a lock, digits fallback.

Data sources, in order (see :func:`resolve_data`):

1. ``--data-dir``: a folder holding the four IDX files (raw or ``.gz``);
2. the cache folder (``$DDPKIT_CACHE_DIR/mnist``, else ``$XDG_CACHE_HOME/ddpkit/mnist``, else
   ``~/.cache/ddpkit/mnist``);
3. a download from the public MNIST mirrors into the cache — one process downloads while the
   others wait on a file lock; each file is verified and renamed into place atomically;
4. offline, with nothing found: scikit-learn's 8x8 digits, upsampled to 28x28, said in one line.

Every MNIST file is checked against the SHA-256 of its *decompressed* bytes (the original IDX
files published by LeCun, Cortes and Burges), so a truncated or altered file never trains.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import gzip
import hashlib
import http.client
import importlib.metadata
import os
import pickle
import tempfile
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from ddpkit.app.mnist.choices import DATASETS  # noqa: F401 (re-exported; torch-free)
from ddpkit.app.mnist.model import MODEL_NAMES
from ddpkit.errors import ConfigError, DataError

# SHA-256 of the decompressed original IDX files.
MNIST_SHA256 = {
    "train-images-idx3-ubyte": "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
    "train-labels-idx1-ubyte": "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
    "t10k-images-idx3-ubyte": "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    "t10k-labels-idx1-ubyte": "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
}
SPLIT_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
# The mirrors torchvision uses; DDPKIT_MNIST_MIRRORS (comma-separated base URLs) replaces them.
MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
    "http://yann.lecun.com/exdb/mnist/",
)
MIRRORS_ENV = "DDPKIT_MNIST_MIRRORS"
# Mean and standard deviation of the MNIST training pixels scaled to [0, 1] (PyTorch's MNIST
# example, pytorch/examples mnist/main.py).
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
# Passes over the training set when the user gives no --epochs. MNIST: one (0.988 test accuracy
# with the MNIST CNN). Digits: 1,437 training images are only 12 steps of a 2-rank global batch;
# the digits CNN needs 20 passes (240 steps) for 0.96-0.98 test accuracy on 360 held-out images,
# in about 3 s of training (measured on 2 CPU cores, torch 2.13, seeds 0-2, 2 ranks x 64).
DEFAULT_EPOCHS = {"mnist": 1, "digits": 20}
# Peak private memory of one rank of `ddpkit train --nproc 2`, MiB: RssAnon of each worker
# sampled every 50 ms from /proc/PID/status, plus 3 MiB for its stderr copier (2 CPU cores,
# torch 2.13.0+cpu, gloo, batch 64). MNIST: 722-727 MiB (the 60,000 training images as float32
# are 188 MB of it); digits: 280-285 MiB. The launcher refuses an --nproc that cannot fit.
RANK_MEMORY_MIB = {"mnist": 730.0, "digits": 290.0}
_IDX_DTYPES: dict[int, type[np.generic] | str] = {
    0x08: np.uint8,
    0x09: np.int8,
    0x0B: ">i2",
    0x0C: ">i4",
    0x0D: ">f4",
    0x0E: ">f8",
}


def default_cache_dir() -> Path:
    """Where downloaded MNIST files are kept."""
    if os.environ.get("DDPKIT_CACHE_DIR"):
        return Path(os.environ["DDPKIT_CACHE_DIR"]) / "mnist"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ddpkit" / "mnist"


def find_file(directory: Path, name: str) -> Path | None:
    """``directory/name`` or ``directory/name.gz``, whichever exists (raw first)."""
    for candidate in (directory / name, directory / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    return None


def read_bytes(path: Path) -> bytes:
    """The file's content, decompressed when it is gzip (detected by its magic bytes)."""
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        try:
            return gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as exc:
            raise DataError(
                f"corrupt gzip file: path={path} ({exc}). Delete it and download it again."
            ) from None
    return data


def verify_sha256(data: bytes, name: str, path: Path) -> None:
    """Raise :class:`DataError` unless ``data`` hashes to the known value for ``name``."""
    actual = hashlib.sha256(data).hexdigest()
    expected = MNIST_SHA256[name]
    if actual != expected:
        raise DataError(
            f"MNIST file failed its checksum: path={path}, sha256={actual}, expected "
            f"sha256={expected} (of the decompressed bytes). The file is truncated or altered: "
            "delete it and download it again."
        )


def parse_idx(data: bytes, path: Path) -> np.ndarray:
    """Parse an IDX file (magic ``0 0 dtype ndim``, big-endian int32 dims, then the values).

    Raises:
        DataError: bad magic, unknown dtype, or a size that does not match the header.
    """
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES:
        raise DataError(f"not an IDX file: path={path}. Expected the MNIST IDX format.")
    ndim = data[3]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DataError(f"truncated IDX header: path={path}. Download the file again.")
    shape = tuple(int(d) for d in np.frombuffer(data, ">i4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_DTYPES[data[2]])
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(data) - header != expected:
        raise DataError(
            f"IDX file size does not match its header: path={path}, shape={shape}, "
            f"{len(data) - header} bytes of data, expected {expected}. Download it again."
        )
    return np.frombuffer(data, dtype, offset=header).reshape(shape)


def load_idx_split(directory: Path, split: str, verify: bool = True) -> TensorDataset:
    """One MNIST split from ``directory`` as tensors.

    Returns:
        ``TensorDataset(images, labels)``: images ``(N, 1, 28, 28)`` float32 normalized with
        ``MNIST_MEAN``/``MNIST_STD``; labels ``(N,)`` int64. N = 60000 (train) or 10000 (test).

    Raises:
        DataError: a file is missing, corrupt, fails its checksum, or images and labels differ
            in count.
    """
    arrays = []
    for name in SPLIT_FILES[split]:
        path = find_file(directory, name)
        if path is None:
            raise DataError(
                f"MNIST file missing: {name}[.gz] not in data_dir={directory}. Put the four IDX "
                "files there, or omit --data-dir to use the cache/download."
            )
        data = read_bytes(path)
        if verify:
            verify_sha256(data, name, path)
        arrays.append(parse_idx(data, path))
    images, labels = arrays
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise DataError(
            f"MNIST {split} images {images.shape} and labels {labels.shape} do not match in "
            f"{directory}. Expected (N, 28, 28) images and (N,) labels."
        )
    # in place: one float32 copy of the images instead of four (60,000 images: 188 MB each);
    # the same operations in the same order, so the values are bitwise those of
    # ``(images / 255.0 - MNIST_MEAN) / MNIST_STD``
    x = images.astype(np.float32)
    x /= 255.0
    normalized = torch.from_numpy(x).unsqueeze(1).sub_(MNIST_MEAN).div_(MNIST_STD)
    return TensorDataset(normalized, torch.from_numpy(labels.astype(np.int64)))


def verify_files(directory: Path) -> None:
    """Check all four MNIST files in ``directory`` against their SHA-256 (about 1 s).

    Raises:
        DataError: a file is missing, not valid gzip, or fails its checksum; names the file.
    """
    for name in MNIST_SHA256:
        path = find_file(directory, name)
        if path is None:
            raise DataError(f"MNIST file missing: {name}[.gz] not in {directory}.")
        verify_sha256(read_bytes(path), name, path)


def missing_files(directory: Path) -> list[str]:
    """Names of the four MNIST files not present in ``directory`` (raw or .gz)."""
    return [name for name in MNIST_SHA256 if find_file(directory, name) is None]


def mirrors() -> list[str]:
    """Base URLs to download from (``DDPKIT_MNIST_MIRRORS`` overrides the defaults)."""
    override = os.environ.get(MIRRORS_ENV)
    urls = override.split(",") if override else list(MIRRORS)
    return [u.strip().rstrip("/") + "/" for u in urls if u.strip()]


def _fetch_one(name: str, directory: Path, timeout_s: float) -> list[str]:
    """Try each mirror for ``name``; write the verified ``.gz`` atomically. Returns the errors."""
    errors = []
    for base in mirrors():
        url = f"{base}{name}.gz"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310
                payload = response.read()
            verify_sha256(gzip.decompress(payload), name, Path(url))
        except (OSError, EOFError, ValueError, zlib.error, http.client.HTTPException) as exc:
            # URLError is an OSError, DataError a ValueError; a malformed URL is a ValueError
            errors.append(f"{url}: {exc}")
            continue
        tmp = directory / f".{name}.gz.{os.getpid()}.tmp"
        with open(tmp, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, directory / f"{name}.gz")
        return []
    return errors


def download_mnist(directory: Path, timeout_s: float = 10.0) -> None:
    """Download the missing MNIST files into ``directory``, one process at a time.

    Processes that call it together (every rank, every node sharing the folder) take an
    exclusive ``flock`` on ``directory/.lock``; the first downloads, the others wait, then find
    the files present and return. Not a collective.

    Raises:
        DataError: some file could not be had from any mirror; lists each URL's error.
    """
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        errors: list[str] = []
        for name in missing_files(directory):
            errors += _fetch_one(name, directory, timeout_s)
            if errors:
                break
    if errors:
        raise DataError(f"MNIST download failed into {directory}: {'; '.join(errors)}")


def load_digits_split(split: str, seed: int = 0) -> TensorDataset:
    """scikit-learn's 8x8 digits (1,797 images), upsampled to ``(N, 1, 28, 28)``, split 80/20.

    The split is stratified with a fixed ``seed``, so every rank builds the same one. The first
    call on a machine keeps both splits in the cache folder (``digits-<sklearn version>-<seed>
    .pt`` beside ``mnist/``, written atomically); later calls, every rank of every later job,
    read that file instead of importing scikit-learn (about 1.5 s of CPU per process on 2 cores).

    Raises:
        ConfigError: scikit-learn is not installed (``pip install 'ddpkit[digits]'``).
    """
    try:
        version = importlib.metadata.version("scikit-learn")
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(
            "dataset=digits needs scikit-learn, which is not installed. "
            "Install it with: pip install 'ddpkit[digits]'."
        ) from None
    path = default_cache_dir().parent / f"digits-{version}-{seed}.pt"
    try:
        splits = torch.load(path, weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError):  # absent or unreadable
        splits = _digits_splits(seed)
        _save_atomic(splits, path)
    return TensorDataset(*splits[split])


def _digits_splits(seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Both splits, computed: ``{"train"|"test": (images (N, 1, 28, 28) float32, labels (N,))}``."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        bunch.images, bunch.target, test_size=0.2, random_state=seed, stratify=bunch.target
    )
    splits = {}
    for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
        images = torch.from_numpy(x.astype(np.float32) / 16.0).unsqueeze(1)
        images = torch.nn.functional.interpolate(images, size=(28, 28), mode="bilinear")
        splits[split] = ((images - MNIST_MEAN) / MNIST_STD, torch.from_numpy(y.astype(np.int64)))
    return splits


def _save_atomic(payload: object, path: Path) -> None:
    """``torch.save`` to a temporary file beside ``path``, then rename; nothing on failure (a
    read-only cache only costs the next process the computation again)."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "wb") as handle:
            torch.save(payload, handle)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


@dataclass(frozen=True)
class DataSource:
    """The data set the job will train on.

    Attributes:
        dataset: ``"mnist"`` or ``"digits"``.
        directory: the folder holding the MNIST files (``None`` for digits).
        note: a line to tell the user (e.g. why digits was chosen); empty when nothing to say.
    """

    dataset: str
    directory: Path | None = None
    note: str = ""

    def with_epochs(self, epochs: int | None) -> tuple[int, DataSource]:
        """The epoch count to train (the user's, else this data set's default) and the source
        whose note (if any) ends by naming the model and that count.

        Example:
            >>> DataSource("digits", note="MNIST unavailable.").with_epochs(None)[0]
            20
        """
        chosen = DEFAULT_EPOCHS[self.dataset] if epochs is None else epochs
        if not self.note or self.dataset != "digits":
            return chosen, self
        default = DEFAULT_EPOCHS[self.dataset]
        how = "--epochs to change" if epochs is None else "your --epochs"
        if epochs is not None and epochs < default:  # e.g. --epochs 1, meant for MNIST
            how += f"; without it {default} epochs, which reach test accuracy 0.95+"
        model = MODEL_NAMES[self.dataset]
        count = f"{chosen} epoch{'s' if chosen != 1 else ''}"
        note = f"{self.note.rstrip('.')}, with {model} for {count} ({how})."
        return chosen, dataclasses.replace(self, note=note)

    def load(self, split: str) -> TensorDataset:
        """The ``train`` or ``test`` split (not re-hashed: :func:`resolve_data` verified it)."""
        if self.dataset == "digits":
            return load_digits_split(split)
        assert self.directory is not None
        return load_idx_split(self.directory, split, verify=False)


def resolve_data(
    dataset: str = "auto", data_dir: str | os.PathLike[str] | None = None, download: bool = True
) -> DataSource:
    """Decide where the data comes from, downloading MNIST into the cache when needed.

    Args:
        dataset: ``auto`` (MNIST if it can be had, else digits), ``mnist`` or ``digits``.
        data_dir: a folder that already holds the MNIST files; nothing is downloaded into it.
        download: allow downloading into the cache.

    Raises:
        ConfigError: unknown dataset; ``data_dir`` missing, not a folder, or lacking files.
        DataError: a file found fails its checksum; or ``dataset="mnist"`` and the files can be
            neither found nor downloaded.
    """
    if dataset not in ("auto", "mnist", "digits"):
        raise ConfigError(f"unknown dataset: dataset={dataset!r}. Allowed: auto, mnist, digits.")
    if dataset == "digits":
        return DataSource("digits")
    if data_dir is not None:
        directory = Path(data_dir).expanduser()
        if not directory.is_dir():
            raise ConfigError(
                f"data dir not found: data_dir={directory}. Point --data-dir at a folder holding "
                "the four MNIST IDX files, or omit it to use the cache/download."
            )
        absent = missing_files(directory)
        if absent:
            raise ConfigError(
                f"data dir lacks MNIST files: data_dir={directory}, missing {', '.join(absent)} "
                "(raw or .gz). Add them, or omit --data-dir to use the cache/download."
            )
        verify_files(directory)
        return DataSource("mnist", directory)
    cache = default_cache_dir()
    if not missing_files(cache):
        verify_files(cache)
        return DataSource("mnist", cache)
    if download:
        try:
            download_mnist(cache)
            return DataSource("mnist", cache, f"downloaded MNIST into {cache}")
        except DataError as exc:
            if dataset == "mnist":
                raise
            first_error = str(exc).split("; ")[0].split(": ", 2)[-1]  # the first mirror's error
            reason = f"download failed: {first_error[:120]}"
    else:
        reason = "downloads disabled"
    if dataset == "mnist":
        raise DataError(f"MNIST not found in {cache} and downloads are disabled. Use --data-dir.")
    return DataSource(
        "digits",
        note=f"MNIST unavailable (no files in {cache}; {reason}); "
        "training on scikit-learn's 8x8 digits, upsampled to 28x28, instead.",
    )
