"""MNIST data: IDX parsing, checksum verification, download from a loopback mirror, fallback."""

from __future__ import annotations

import gzip
import http.server
import multiprocessing as mp
import shutil
import struct
import threading
from pathlib import Path

import numpy as np
import pytest

from ddpkit.app.mnist import data as mnist_data
from ddpkit.app.mnist.data import (
    MNIST_SHA256,
    download_mnist,
    load_idx_split,
    parse_idx,
    resolve_data,
)
from ddpkit.errors import ConfigError, DataError


def _idx_bytes(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}i", *array.shape)
    return header + array.astype(np.uint8).tobytes()


def test_parse_idx_reads_shape_and_values():
    images = np.arange(2 * 3 * 4).reshape(2, 3, 4)
    parsed = parse_idx(_idx_bytes(images), Path("x"))
    assert parsed.shape == (2, 3, 4) and (parsed == images).all()


@pytest.mark.parametrize(
    "data,message",
    [
        (b"\x00\x00\x08\x01\x00\x00\x00\x05abc", "does not match its header"),
        (b"\x01\x02\x03\x04", "not an IDX file"),
        (b"\x00\x00\x08\x03\x00\x00", "truncated IDX header"),
    ],
)
def test_parse_idx_rejects_bad_files(data, message):
    with pytest.raises(DataError, match=message):
        parse_idx(data, Path("bad"))


def test_shared_files_load_with_expected_shapes(mnist_dir):
    test = load_idx_split(mnist_dir, "test")
    images, labels = test.tensors
    assert tuple(images.shape) == (10000, 1, 28, 28) and tuple(labels.shape) == (10000,)
    assert sorted(labels.unique().tolist()) == list(range(10))
    assert abs(float(images.mean())) < 0.1  # normalized with the MNIST mean/std


def test_images_are_bitwise_the_normalization_formula(mnist_dir):
    # the split is normalized in place (one float32 copy, not four); its values must be bitwise
    # those of the formula written out, which resumes and cross-run comparisons rely on
    import torch

    mean, std = mnist_data.MNIST_MEAN, mnist_data.MNIST_STD
    raw = gzip.decompress((mnist_dir / "t10k-images-idx3-ubyte.gz").read_bytes())
    pixels = np.frombuffer(raw, np.uint8, offset=16).reshape(10000, 1, 28, 28)
    formula = (torch.from_numpy(pixels.astype(np.float32) / 255.0) - mean) / std
    images = load_idx_split(mnist_dir, "test").tensors[0]
    assert images.dtype == torch.float32 and images.is_contiguous()
    assert torch.equal(images, formula)


def test_truncated_file_is_named_with_its_expected_hash(mnist_dir, tmp_path):
    for path in mnist_dir.glob("*.gz"):
        shutil.copy(path, tmp_path)
    raw = gzip.decompress((tmp_path / "t10k-labels-idx1-ubyte.gz").read_bytes())
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(raw[:-10])  # raw files are accepted too
    with pytest.raises(DataError) as info:
        load_idx_split(tmp_path, "test")
    message = str(info.value)
    assert "t10k-labels-idx1-ubyte" in message
    assert MNIST_SHA256["t10k-labels-idx1-ubyte"] in message
    assert len(message.splitlines()) == 1


class _Mirror:
    """A loopback HTTP server (port chosen by the OS) serving a folder; counts requests."""

    def __init__(self, root: Path):
        handler = self._handler(root)
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.gets: list[str] = []
        self.server.gets = self.gets  # type: ignore[attr-defined]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @staticmethod
    def _handler(root: Path):
        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, directory=str(root), **kwargs)

            def do_GET(self):  # noqa: N802
                self.server.gets.append(self.path)
                super().do_GET()

            def log_message(self, *args):
                pass

        return Handler

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def _download_in_child(cache: str, mirror: str) -> None:
    import os

    os.environ[mnist_data.MIRRORS_ENV] = mirror
    download_mnist(Path(cache))


@pytest.mark.slow
def test_download_verifies_caches_and_runs_once_across_processes(mnist_dir, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    with _Mirror(mnist_dir) as mirror:
        monkeypatch.setenv("DDPKIT_CACHE_DIR", str(cache))
        monkeypatch.setenv(mnist_data.MIRRORS_ENV, mirror.url)
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=_download_in_child, args=(str(cache / "mnist"), mirror.url))
            for _ in range(2)
        ]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout=60)
        assert [proc.exitcode for proc in procs] == [0, 0]
        assert sorted(mirror.gets) == sorted(f"/{name}.gz" for name in MNIST_SHA256)  # once each
        source = resolve_data("auto")
    assert source.dataset == "mnist" and source.directory == cache / "mnist"
    assert not list((cache / "mnist").glob("*.tmp"))
    assert len(source.load("test")) == 10000


def test_corrupt_download_is_refused(mnist_dir, tmp_path, monkeypatch):
    served = tmp_path / "served"
    shutil.copytree(mnist_dir, served)
    bad = gzip.compress(gzip.decompress((served / "train-labels-idx1-ubyte.gz").read_bytes())[:-1])
    (served / "train-labels-idx1-ubyte.gz").write_bytes(bad)
    monkeypatch.setenv("DDPKIT_CACHE_DIR", str(tmp_path / "cache"))
    with _Mirror(served) as mirror:
        monkeypatch.setenv(mnist_data.MIRRORS_ENV, mirror.url)
        with pytest.raises(DataError) as info:
            resolve_data("mnist")
    assert MNIST_SHA256["train-labels-idx1-ubyte"] in str(info.value)
    assert not (tmp_path / "cache" / "mnist" / "train-labels-idx1-ubyte.gz").exists()


def test_offline_falls_back_to_digits_with_a_note(tmp_path, monkeypatch):
    pytest.importorskip("sklearn")
    monkeypatch.setenv("DDPKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(mnist_data.MIRRORS_ENV, "http://127.0.0.1:1/")  # nothing listens there
    source = resolve_data("auto")
    assert source.dataset == "digits"
    assert "MNIST unavailable" in source.note and "digits" in source.note
    assert len(source.note.splitlines()) == 1
    train, test = source.load("train"), source.load("test")
    assert len(train) + len(test) == 1797
    assert tuple(train.tensors[0].shape[1:]) == (1, 28, 28)
    with pytest.raises(DataError, match="MNIST download failed"):
        resolve_data("mnist")


def test_unknown_dataset_is_a_config_error():
    with pytest.raises(ConfigError, match="Allowed: auto, mnist, digits"):
        resolve_data("fashion")


@pytest.mark.slow
def test_digits_splits_are_cached_and_read_back_without_scikit_learn(tmp_path, monkeypatch):
    pytest.importorskip("sklearn")
    import subprocess
    import sys

    import torch

    monkeypatch.setenv("DDPKIT_CACHE_DIR", str(tmp_path))
    first = mnist_data.load_digits_split("test")
    cached = list(tmp_path.glob("digits-*-0.pt"))
    assert len(cached) == 1 and not list(tmp_path.glob(".digits-*"))  # no temporary left
    computed = mnist_data._digits_splits(0)["test"]
    assert all(torch.equal(a, b) for a, b in zip(first.tensors, computed, strict=True))
    # a later process (a rank of a later job) reads the file and never imports scikit-learn
    code = (
        "import sys, torch; from ddpkit.app.mnist.data import load_digits_split; "
        "d = load_digits_split('test'); print('sklearn' in sys.modules, len(d), "
        "float(d.tensors[0].sum()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    assert out[:2] == ["False", "360"]
    assert float(out[2]) == float(first.tensors[0].sum())
    # an unreadable cache file is recomputed and replaced, not an error
    cached[0].write_bytes(b"not a torch file")
    again = mnist_data.load_digits_split("test")
    assert torch.equal(again.tensors[1], first.tensors[1])
    assert torch.load(cached[0], weights_only=True)["test"][1].shape == (360,)
