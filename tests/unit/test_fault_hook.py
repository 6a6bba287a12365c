"""tests/faults/sitecustomize.py, the hook that injects the e2e tests' faults: it can never
turn a fault off silently, and it hides no other ``sitecustomize``.

Each case runs a fresh interpreter with the hook first on ``PYTHONPATH``, as
:func:`tests.helpers.fault_env` sets it for ``ddpkit train``'s processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import FAULTS_DIR

FAULT_VARIABLES = ("DDPKIT_FAULT_INJECT", "DDPKIT_TEST_SLOW_SAVE_S", "DDPKIT_TEST_SLOW_EVAL_S")


def run_python(code: str, *, pythonpath: list[Path], **variables: str):
    """``python -c code`` with ``pythonpath`` first and only ``variables`` of the faults set."""
    env = {key: value for key, value in os.environ.items() if key not in FAULT_VARIABLES}
    env.pop("WORLD_SIZE", None)
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    paths = [str(path) for path in pythonpath]
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**env, **variables},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("variable", "value", "extra"),
    [
        ("DDPKIT_FAULT_INJECT", "1-10", {}),
        ("DDPKIT_FAULT_INJECT", "1:x", {}),
        ("DDPKIT_FAULT_INJECT", "1:0", {}),  # STEP counts from 1
        ("DDPKIT_FAULT_INJECT", "-1:3", {}),
        ("DDPKIT_FAULT_INJECT", "2:3", {"WORLD_SIZE": "2"}),  # no rank 2 in this job
        ("DDPKIT_TEST_SLOW_SAVE_S", "soon", {}),
        ("DDPKIT_TEST_SLOW_EVAL_S", "-3", {}),
    ],
)
def test_a_bad_value_ends_the_process_loudly(variable, value, extra):
    result = run_python("print('ran')", pythonpath=[FAULTS_DIR], **{variable: value}, **extra)
    assert result.returncode == 2, result
    assert "ran" not in result.stdout
    assert f"tests/faults: invalid {variable}={value!r}" in result.stderr


def test_a_good_value_on_a_later_attempt_runs():
    result = run_python(
        "print('ran')",
        pythonpath=[FAULTS_DIR],
        DDPKIT_FAULT_INJECT="1:3",
        WORLD_SIZE="2",
        TORCHELASTIC_RESTART_COUNT="1",
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, "ran\n", "")


@pytest.mark.slow
def test_find_spec_before_the_import_leaves_the_patch_in_place():
    code = (
        "import importlib.util\n"
        "assert importlib.util.find_spec('ddpkit.training.loop') is not None\n"
        "from ddpkit.training import loop\n"
        "print(loop.train_epoch.__code__.co_filename, loop.train_epoch.__wrapped__.__module__)\n"
    )
    result = run_python(code, pythonpath=[FAULTS_DIR], DDPKIT_FAULT_INJECT="0:3")
    assert result.returncode == 0, result
    assert result.stdout.split() == [str(FAULTS_DIR / "sitecustomize.py"), "ddpkit.training.loop"]


def test_a_missing_target_module_ends_the_process_loudly(tmp_path):
    # A ddpkit whose training package has no loop module (as after a rename), found first.
    (tmp_path / "ddpkit" / "training").mkdir(parents=True)
    (tmp_path / "ddpkit" / "__init__.py").write_text("")
    (tmp_path / "ddpkit" / "training" / "__init__.py").write_text("")
    result = run_python(
        "print('ran')", pythonpath=[FAULTS_DIR, tmp_path], DDPKIT_FAULT_INJECT="0:3"
    )
    assert result.returncode == 2, result
    assert "ran" not in result.stdout
    assert "tests/faults: DDPKIT_FAULT_INJECT: module ddpkit.training.loop is gone" in (
        result.stderr
    )


def test_the_next_sitecustomize_still_runs(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("print('the system sitecustomize ran')\n")
    result = run_python("print('ran')", pythonpath=[FAULTS_DIR, tmp_path])
    assert result.returncode == 0, result
    assert result.stdout == "the system sitecustomize ran\nran\n"
