"""Every ``ddpkit <command> --flag`` the docs show is a flag of that command.

Commands: ``ddpkit train|run|doctor|plot|checkpoint export|bench <name>`` in README.md and
docs/*.md, in code blocks (a line, with ``\\`` continuations joined) and in inline code spans
(which may wrap across lines). Each option token is looked up in the parser ``ddpkit`` itself
builds (``ddpkit.cli.build_parser``), so a renamed or removed flag fails here, not in a
newcomer's shell. ``ddpkit run``'s options end at the script (or ``-m MODULE``): what follows
belongs to the script. The flags table of docs/train.md is checked against ``ddpkit train``.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from ddpkit.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
COMMAND = re.compile(r"(?<![\w-])ddpkit ((?:bench|checkpoint) \w+|\w+)(?=\s|$)(.*)")
SPAN = re.compile(r"`([^`]+)`")
END = re.compile(r"\s(?:#|\||&&|;|>|2>)")  # a comment, pipe, chain or redirection ends it


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse has no public accessor for its subparsers
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """``{"train": parser, "bench allreduce": parser, ...}`` for every leaf command."""
    found = {}
    for name, parser in _subparsers(build_parser()).items():
        nested = _subparsers(parser)
        found.update(
            {f"{name} {sub}": p for sub, p in nested.items()} if nested else {name: parser}
        )
    return found


PARSERS = command_parsers()


def mentions() -> list[tuple[str, str, str]]:
    """``(doc, command, the rest of the line)`` for every ``ddpkit <command> ...`` shown."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        pieces = [
            line
            for block in FENCE.findall(text)
            for line in block.replace("\\\n", " ").splitlines()
        ]
        pieces += [span.replace("\n", " ") for span in SPAN.findall(FENCE.sub("", text))]
        for piece in pieces:
            for match in COMMAND.finditer(piece):
                if match.group(1) in PARSERS:
                    rest = END.split(" " + match.group(2), maxsplit=1)[0]
                    found.append((str(doc.relative_to(REPO)), match.group(1), rest))
    return found


def unknown_flags(parser: argparse.ArgumentParser, rest: str) -> list[str]:
    """The option tokens of ``rest`` that ``parser`` does not define (placeholders allowed)."""
    options = {s: a for a in parser._actions for s in a.option_strings}
    stops_at_positional = any(a.nargs == argparse.REMAINDER for a in parser._actions)
    try:
        tokens = shlex.split(rest)
    except ValueError:  # an unbalanced quote in prose
        tokens = rest.split()
    unknown, skip = [], False
    for token in (t.strip("[]") for t in tokens):
        if skip or not token or token == "...":
            skip = False
            continue
        if not token.startswith("-"):
            if stops_at_positional:
                break  # ddpkit run: the script and its own arguments
            continue
        flag = token.split("=", 1)[0]
        if flag not in options:
            unknown.append(flag)
            continue
        skip = options[flag].nargs != 0 and "=" not in token
        if options[flag].dest == "module":  # -m MODULE: the module's arguments follow
            break
    return unknown


MENTIONS = mentions()


def test_the_docs_show_commands_to_check():
    commands = {command for _, command, _ in MENTIONS}
    assert {"train", "run", "doctor", "plot", "checkpoint export", "bench allreduce"} <= commands
    assert ("docs/launching.md", "run") in {(doc, command) for doc, command, _ in MENTIONS}


def test_the_flag_check_sees_a_wrong_flag_and_stops_at_the_script():
    assert unknown_flags(PARSERS["train"], "--nproc 2 --epoch 3") == ["--epoch"]
    assert unknown_flags(PARSERS["run"], "-n 2 train.py --epochs 3 --lr=1") == []
    assert unknown_flags(PARSERS["run"], "-n 2 -m pkg.train --lr 0.1") == []
    assert unknown_flags(PARSERS["run"], "--nproc=2 --bogus train.py") == ["--bogus"]


@pytest.mark.parametrize(
    ("doc", "command", "rest"), MENTIONS, ids=[f"{d}:{c} {r}"[:90] for d, c, r in MENTIONS]
)
def test_every_flag_shown_with_a_command_is_in_its_help(doc, command, rest):
    unknown = unknown_flags(PARSERS[command], rest)
    assert not unknown, f"{doc} shows `ddpkit {command}{rest}`: no such flag {unknown}"


def train_table_flags() -> list[str]:
    text = (REPO / "docs" / "train.md").read_text()
    table = text.split("## Options", 1)[1].split("\n## ", 1)[0]
    rows = [
        re.split(r"(?<!\\)\|", line)[1] for line in table.splitlines() if line.startswith("| `")
    ]
    return [flag for row in rows for flag in re.findall(r"`(--[\w-]+\*?)", row)]


def test_the_train_page_flags_table_names_flags_of_ddpkit_train():
    flags = train_table_flags()
    assert "--strategy" in flags and "--powersgd-*" in flags
    options = {s for a in PARSERS["train"]._actions for s in a.option_strings}

    def exists(flag: str) -> bool:  # --powersgd-*: some flag with that prefix
        return (
            any(o.startswith(flag[:-1]) for o in options)
            if flag.endswith("*")
            else (flag in options)
        )

    missing = [flag for flag in flags if not exists(flag)]
    assert not missing, f"docs/train.md's flags table names flags ddpkit train lacks: {missing}"
