"""Placeholder: `ddpkit bench overhead` is being built (issue 7)."""

from __future__ import annotations

import argparse

from ddpkit.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser


def run(args: argparse.Namespace) -> int:
    raise ConfigError("ddpkit bench overhead is not built yet")
