"""The flag set of ``ddpkit train`` is frozen: option strings, destinations, defaults, choices,
types and metavars (not the wording of the help) must equal tests/cli/snapshots/train_flags.json.

A change here changes what users type. When it is on purpose, regenerate the snapshot with
``DDPKIT_UPDATE_SNAPSHOT=1 pytest tests/cli/test_train_help_snapshot.py`` and commit the file.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from ddpkit.app.mnist.config import TrainConfig
from ddpkit.cli import build_parser

SNAPSHOT = Path(__file__).parent / "snapshots" / "train_flags.json"
UPDATE = "DDPKIT_UPDATE_SNAPSHOT"


def flag_table() -> dict[str, dict]:
    """``{first option string: what the parser does with it}`` for ``ddpkit train``."""
    train = build_parser().get_default("subcommand_parsers")["train"]
    defaults = TrainConfig()
    table = {}
    for action in train._actions:
        default = action.default
        if default == argparse.SUPPRESS and hasattr(defaults, action.dest):
            default = getattr(defaults, action.dest)  # settings flags: the field's default
        table[action.option_strings[0]] = {
            "option_strings": action.option_strings,
            "dest": action.dest,
            "default": default,
            "choices": list(action.choices) if action.choices else None,
            "type": getattr(action.type, "__name__", None),
            "nargs": action.nargs,
            "metavar": action.metavar,
            "hidden": action.help == argparse.SUPPRESS,
        }
    return dict(sorted(table.items()))


def test_train_flags_match_the_snapshot():
    table = flag_table()
    if os.environ.get(UPDATE) == "1":
        SNAPSHOT.write_text(json.dumps(table, indent=1) + "\n")
        pytest.skip(f"wrote {SNAPSHOT}; commit it")
    frozen = json.loads(SNAPSHOT.read_text())
    added = sorted(set(table) - set(frozen))
    removed = sorted(set(frozen) - set(table))
    changed = {
        flag: (frozen[flag], table[flag])
        for flag in set(table) & set(frozen)
        if frozen[flag] != json.loads(json.dumps(table[flag]))
    }
    assert not (added or removed or changed), (
        f"the flags of `ddpkit train` changed: added {added}, removed {removed}, changed "
        f"(snapshot, now) {changed}. Users type these flags: keep them, or, if the change is "
        f"on purpose, regenerate the snapshot with `{UPDATE}=1 pytest {__file__}` and commit "
        f"{SNAPSHOT.relative_to(Path(__file__).parents[2])}."
    )


def test_help_groups_the_flags_by_section(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    text = capsys.readouterr().out
    titles = [line for line in text.splitlines() if line.endswith("in --config):")]
    assert [t.rsplit("[", 1)[1].split("]")[0] for t in titles] == [
        "run",
        "data",
        "launch",
        "runtime",
        "wrap",
        "step",
        "guards",
        "checkpoint",
        "observe",
    ]
    assert "%" not in text.replace("%%", "")  # no measured figure left in the help
