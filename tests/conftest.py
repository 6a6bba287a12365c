"""Hygiene for every test: environment restored, no process group or ddpkit handler left behind."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_MNIST = REPO.parent / "shared" / "data" / "mnist"
LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)


@pytest.fixture(autouse=True)
def _restore_environment(monkeypatch):
    """Each test starts without launcher variables and gets the environment back afterwards."""
    saved = dict(os.environ)
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    for name in [n for n in os.environ if n.startswith("SLURM_")]:
        monkeypatch.delenv(name, raising=False)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _restore_signal_handlers():
    """A runtime a test left open keeps its stop-signal handlers: put the previous ones back."""
    import signal

    names = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
    saved = {sig: signal.getsignal(sig) for sig in names}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("test left a process group initialised")


@pytest.fixture(autouse=True)
def _reset_ddpkit_logger():
    yield
    logger = logging.getLogger("ddpkit")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    logger.propagate = True


@pytest.fixture
def mnist_dir() -> Path:
    """The four original MNIST files shared with the project (skips where absent)."""
    names = (
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    )
    missing = [f"{n}.gz" for n in names if not (SHARED_MNIST / f"{n}.gz").is_file()]
    if missing:
        reason = (
            f"needs the MNIST files in {SHARED_MNIST} (../shared/data/mnist beside the clone, "
            f"where CI puts them); missing: {', '.join(missing)}"
        )
        if os.environ.get("CI"):  # CI lays shared/ beside the clone: missing files are a failure
            pytest.fail(reason)
        pytest.skip(reason)
    return SHARED_MNIST


# Tiers: every test gets the marker of its folder; `slow` is set by hand on the long ones.
# The inner loop while changing code: pytest -m "not slow" (see README).
_FOLDER_MARKERS = {
    "distributed": "distributed",
    "e2e": "e2e",
    "live": "live",
    "multinode": "multinode",
    "slurm": "slurm",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        if folder in _FOLDER_MARKERS:
            item.add_marker(getattr(pytest.mark, _FOLDER_MARKERS[folder]))
        if folder in ("e2e", "live", "multinode", "slurm"):
            item.add_marker(pytest.mark.slow)
