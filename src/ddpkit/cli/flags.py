"""argparse flags generated from settings dataclasses (:mod:`ddpkit.settings`).

Each section becomes one argument group titled with its class's first docstring line; each
field one flag: ``--name-with-dashes`` (or the field's ``flag``), its help, its ``metavar`` and
``choices``, ``type`` from the annotation; a ``bool`` field is a switch (``store_true``, or
``store_false`` under a ``--no-...`` flag when it defaults to True) or, with ``on_off``, takes
``on``/``off``. The flags default to *absent* (``argparse.SUPPRESS``), so :func:`given_settings`
returns exactly what the command line set, to lay over the defaults and a config file.
"""

from __future__ import annotations

import argparse
from collections.abc import Collection, Mapping
from typing import Any

from ddpkit.settings import field_kinds, fields_of, flag_of, help_of, option_of


def add_settings_arguments(
    parser: argparse.ArgumentParser,
    sections: Mapping[str, type],
    *,
    config_file: bool = True,
    short: Mapping[str, str] | None = None,
    required: Collection[str] = (),
    notes: Mapping[str, str] | None = None,
) -> None:
    """One argument group per section (``{"step": StepConfig, ...}``), one flag per field.

    Args:
        parser: the command's parser.
        sections: ``{section name: settings class}``.
        config_file: whether the command reads the sections from ``--config`` (said in the
            group titles).
        short: ``{field name: "-n"}``: a short flag before the long one.
        required: the names of the fields the command line must give.
        notes: ``{field name: text}``: what this command adds to a shared field's help (a
            section shared by two commands states only what holds for both).
    """
    for name, cls in sections.items():
        title = (cls.__doc__ or name).strip().splitlines()[0]
        group = parser.add_argument_group(
            f"{title} ([{name}] in --config)" if config_file else title
        )
        for field in fields_of(cls):
            flags = [flag_of(field)]
            if short and field.name in short:
                flags.insert(0, short[field.name])
            argument = _argument(cls, field)
            if notes and field.name in notes:
                argument["help"] += _escaped(notes[field.name])
            group.add_argument(*flags, **argument, required=field.name in required)


def _argument(cls: type, field: Any) -> dict[str, Any]:
    opt, kind = option_of(field), field_kinds(cls)[field.name]
    common = {"dest": field.name, "default": argparse.SUPPRESS, "help": _escaped(help_of(field))}
    if kind is bool and opt.on_off:
        return {**common, "type": on_off, "metavar": "{on,off}"}
    if kind is bool:
        return {**common, "action": "store_false" if field.default else "store_true"}
    convert = None if kind is str else kind
    return {**common, "type": convert, "choices": opt.choices, "metavar": opt.metavar}


def _escaped(text: str) -> str:
    return text.replace("%", "%%")  # argparse formats help with %


def on_off(text: str) -> bool:
    """``on`` -> True, ``off`` -> False (an argparse ``type``)."""
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from 'on', 'off')")
    return text == "on"


def given_settings(args: argparse.Namespace, sections: Mapping[str, type]) -> dict[str, Any]:
    """``{field name: value}`` of the settings flags given on the command line (only those)."""
    names = {field.name for cls in sections.values() for field in fields_of(cls)}
    return {name: value for name, value in vars(args).items() if name in names}
