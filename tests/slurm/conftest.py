"""The ``slurm_cluster`` fixture: a real single-node Slurm for this session (see cluster.py).

It installs slurm-wlm and munge where missing and starts the daemons once per session (per
pytest-xdist worker: each worker that runs Slurm tests gets a cluster of its own, in its own
folder and network namespace, so two never meet). Skipped with the reason where Slurm cannot
be installed or started. The daemons are stopped at the end of the session, also when a test
failed or was interrupted.
"""

from __future__ import annotations

import pytest

from tests.slurm.cluster import SlurmCluster, SlurmUnavailable, ensure_installed

INSTALL_TIMEOUT_S = 300.0  # apt-get update + install took ~6.5 s on this CI kind


@pytest.fixture(scope="session")
def slurm_cluster():
    try:
        install_s = ensure_installed(INSTALL_TIMEOUT_S)
        cluster = SlurmCluster.start()
    except SlurmUnavailable as exc:
        pytest.skip(f"no Slurm for these tests: {exc}")
    cluster.install_s = install_s
    try:
        yield cluster
    finally:
        cluster.stop()
