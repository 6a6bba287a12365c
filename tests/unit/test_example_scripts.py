"""examples/train_custom.py reports accuracy on rows it never trained on (#16 §4).

Its runs under ddpkit run and torchrun: tests/cli/test_launcher.py.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_custom.py"


def _example_module():
    spec = importlib.util.spec_from_file_location("train_custom_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines the functions; main() runs only as __main__
    return module


def test_the_test_rows_are_held_out_from_training():
    train_set, test_set = _example_module().make_splits(2048, 500)
    assert len(train_set) == 2048 and len(test_set) == 500
    train_rows = {tuple(row.tolist()) for row in train_set.tensors[0]}
    test_rows = {tuple(row.tolist()) for row in test_set.tensors[0]}
    assert len(test_rows) == 500 and not train_rows & test_rows
    assert "make_splits(2048, 500)" in EXAMPLE.read_text()  # what main() trains and tests on
