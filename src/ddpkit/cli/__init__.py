"""``ddpkit`` command line: one module per subcommand, each with ``add_parser`` and ``run``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

from ddpkit.errors import ConfigError, DataError, DdpkitError


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are a single line (and exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}. See '{self.prog} --help'.\n")


def _version() -> str:
    """``ddpkit X with torch Y`` (torch's version without importing it: the metadata)."""
    from importlib.metadata import PackageNotFoundError, version

    import ddpkit

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "not installed"
    return f"ddpkit {ddpkit.__version__} with torch {torch_version}"


# Every subcommand, in the order of ``ddpkit --help``, with the one-line help its module gives
# it (tests/cli/test_cli_startup.py checks they agree). Module ddpkit.cli.<name> has add_parser
# and run; only the one argv names is imported (train and run import torch, which takes seconds).
SUBCOMMANDS = {
    "train": "train the MNIST CNN with DDP on N local processes",
    "run": "launch a script on N local processes (torchrun underneath)",
    "doctor": "environment report and live checks, for bug reports",
    "bench": "measure all-reduce bandwidth, step-loop overhead and scaling",
    "plot": "PNG plots of a ddpkit train output folder",
    "checkpoint": "export a checkpoint's model as one plain state-dict file",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``ddpkit`` parser with every subcommand's parser, or, given ``command``, only that
    one's: the others are listed by name and help (enough for ``ddpkit --help`` and a usage
    error), their modules left unimported."""
    parser = OneLineParser(
        prog="ddpkit",
        description="PyTorch distributed data-parallel training, correct by default.",
    )
    parser.add_argument("--version", action="version", version=_version())
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for name, summary in SUBCOMMANDS.items():
        if command is None or name == command:
            importlib.import_module(f"ddpkit.cli.{name}").add_parser(subparsers)
        else:
            subparsers.add_parser(name, help=summary)
    parser.set_defaults(subcommand_parsers=subparsers.choices)
    return parser


def _command_in(argv: Sequence[str]) -> str:
    """The subcommand ``argv`` names: its first word that is not an option (``ddpkit`` itself
    takes no option with a value), or ``""`` when none (``ddpkit --help``)."""
    return next((word for word in argv if not word.startswith("-")), "")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ddpkit`` console script; returns the exit status.

    User mistakes (bad flags, missing or corrupt files) print one line and return 2; other
    ddpkit errors (a NaN loss, diverged replicas) print one line and return 1; Ctrl-C prints one
    line and returns 130. Inside a worker that ``ddpkit run`` started, errors propagate
    instead, so the launcher's failure summary names the rank with the exception type and
    message.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_command_in(argv))
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # reported by the subcommand's parser, so the message names it
        args.subcommand_parsers[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    args.argv = argv
    try:
        return int(args.handler(args) or 0)
    except DdpkitError as exc:
        if getattr(args, "_worker", False):
            raise
        text = str(exc)
        for note in getattr(exc, "__notes__", ()):  # ddpkit train: the checkpoint, the command
            text = f"{text.rstrip('.')}; {note}."
        print(f"ddpkit {args.command}: error: {text}", file=sys.stderr)
        return 2 if isinstance(exc, (ConfigError, DataError)) else 1
    except KeyboardInterrupt as exc:  # Ctrl-C: the harness/launcher has stopped the ranks
        if getattr(args, "_worker", False):
            raise
        where = f" {exc}" if str(exc) else ""  # ddpkit train: "after step 37 (epoch 1)"
        print(
            f"ddpkit {args.command}: interrupted (Ctrl-C){where}; every process it started "
            "is stopped.",
            file=sys.stderr,
        )
        return 130
