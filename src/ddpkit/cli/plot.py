"""``ddpkit plot OUTPUT_DIR``: placeholder while it is being built (issue 7)."""

from __future__ import annotations

import argparse

from ddpkit.errors import ConfigError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("plot", help="PNG plots of a ddpkit train output folder")
    parser.add_argument("output_dir")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    raise ConfigError("ddpkit plot is not built yet")
