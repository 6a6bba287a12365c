"""Test hooks live outside the shipped code (issue #25 §4): the tests inject their faults
through tests/faults/sitecustomize.py, which wraps library functions as they are imported."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import ddpkit

SRC = Path(ddpkit.__file__).resolve().parent
FAULTS = Path(__file__).resolve().parents[1] / "faults" / "sitecustomize.py"


def test_the_library_reads_no_test_variable():
    hooks = [
        f"{path.relative_to(SRC)}:{number}"
        for path in sorted(SRC.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"DDPKIT_(TEST_|FAULT_INJECT)", line)
    ]
    assert hooks == []


def test_every_function_a_fault_wraps_exists():
    spec = importlib.util.spec_from_file_location("ddpkit_test_faults", FAULTS)
    assert spec is not None and spec.loader is not None
    faults = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(faults)  # no fault variable set here: installs nothing
    for module_name, name in faults.TARGETS.values():
        assert callable(getattr(importlib.import_module(module_name), name)), (module_name, name)
