"""``ddpkit doctor``'s checks that need no process: the Python fork deadlock (CPython gh-112275)."""

from __future__ import annotations

import pytest

from ddpkit.launch.doctor import check_python_fork


@pytest.mark.parametrize(
    "version",
    [(3, 10, 0), (3, 10, 14), (3, 11, 7), (3, 11, 9)],
)
def test_a_python_whose_fork_can_deadlock_is_a_warning_with_the_fix(version):
    check = check_python_fork(version)
    text = ".".join(map(str, version))
    assert check.name == "python_fork" and check.ok is None
    assert check.detail.startswith(f"Python {text}: a DataLoader worker (or any process) forked")
    assert "CPython gh-112275" in check.detail
    fixed = {10: "3.10.15", 11: "3.11.10"}[version[1]]
    assert f"upgrade to Python {fixed}" in check.detail
    assert "multiprocessing_context='forkserver'" in check.detail


@pytest.mark.parametrize("version", [(3, 10, 15), (3, 11, 10), (3, 12, 0), (3, 13, 1)])
def test_a_python_with_the_fix_passes(version):
    check = check_python_fork(version)
    text = ".".join(map(str, version))
    assert check.ok is True
    assert check.detail == f"Python {text} has CPython's fix for the fork deadlock gh-112275"
