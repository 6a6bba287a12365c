"""The style the project keeps is enforced, not only configured: ``ruff check``, ``ruff format
--check`` and ``mypy`` (settings in pyproject.toml) pass on the whole tree.

Each runs the pinned tool from this interpreter's environment (the ``test`` extra) in a
subprocess; a failure shows the tool's own report.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYTHON_TREES = ["src", "tests", "bench", "examples", "scripts"]


def _run(*command: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *command],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_ruff_check_passes():
    result = _run("ruff", "check", *PYTHON_TREES, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_check_passes_and_no_line_opts_out():
    result = _run("ruff", "format", "--check", *PYTHON_TREES, timeout=120)
    assert result.returncode == 0, "run `ruff format` on:\n" + result.stdout + result.stderr
    opted_out = [
        f"{path.relative_to(ROOT)}:{number}"
        for tree in PYTHON_TREES
        for path in sorted((ROOT / tree).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "fmt: " + "skip" in line or "fmt: " + "off" in line
    ]
    assert not opted_out, "lines kept out of the formatter:\n" + "\n".join(opted_out)


@pytest.mark.slow
def test_mypy_passes():
    result = _run("mypy", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
