"""Typed settings: dataclass fields that carry their own help, check and flag, and TOML files.

A settings class is a frozen dataclass whose fields are declared with :func:`option`. That one
declaration is read by everything else, so a setting is stated once:

- :func:`field_problems` checks every value (type, choices, range) of an instance;
- :func:`resume_keys` lists the fields marked ``resume=True``;
- :func:`read_toml` and :func:`to_toml` read and write a TOML file with one ``[section]`` per
  settings class (``sections`` maps each section name to its class);
- ``ddpkit.cli.flags`` generates the argparse flags, one group per section.

Example:
    >>> from dataclasses import dataclass
    >>> from ddpkit.settings import at_least, field_problems, option
    >>> @dataclass(frozen=True)
    ... class StepConfig:
    ...     grad_accum: int = option(1, "micro-batches per optimizer step", check=at_least(1))
    >>> field_problems(StepConfig(grad_accum=0))
    ['grad_accum=0 must be >= 1']
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import sys
import textwrap
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpkit.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, before it joined the standard library
    import tomli as tomllib

Check = Callable[[Any], "str | None"]  # the rule a bad value breaks, or None when it is fine
KIND_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


@dataclass(frozen=True)
class Option:
    """What a settings field says about itself (kept in the field's metadata)."""

    help: str
    choices: tuple | None = None
    check: Check | None = None
    resume: bool = False  # a resumed run must keep this value (it is saved with checkpoints)
    flag: str | None = None  # the command-line flag; default ``--`` + the name with dashes
    metavar: str | None = None
    on_off: bool = False  # a bool spelled ``on``/``off`` on the command line


def option(default: Any, help: str, **details: Any) -> Any:
    """A dataclass field with its help and checks (the keyword arguments of :class:`Option`)."""
    return dataclasses.field(default=default, metadata={"option": Option(help, **details)})


def option_of(field: dataclasses.Field) -> Option:
    return field.metadata["option"]


def flag_of(field: dataclasses.Field) -> str:
    return option_of(field).flag or "--" + field.name.replace("_", "-")


def help_of(field: dataclasses.Field) -> str:
    """The field's help with ``%(default)s`` filled in (plain text: ``%%`` is ``%``)."""
    shown = field.default
    if isinstance(shown, bool) and option_of(field).on_off:
        shown = "on" if shown else "off"
    elif isinstance(shown, float):
        shown = f"{shown:g}"  # 300.0 -> 300, 0.003 -> 0.003
    return option_of(field).help.replace("%(default)s", str(shown)).replace("%%", "%")


@functools.cache
def field_kinds(cls: type) -> dict[str, type]:
    """``{name: bool | int | float | str}`` of a settings class (``X | None`` gives X)."""
    hints = typing.get_type_hints(cls)
    kinds = {}
    for name, hint in hints.items():
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        kinds[name] = args[0] if args else hint
    return kinds


def at_least(minimum: int) -> Check:
    """A check: the value is ``>= minimum``."""
    return lambda value: None if value >= minimum else f"must be >= {minimum}"


def finite(*, above: float | None = None, at_least: float | None = None) -> Check:
    """A check: a finite number ``> above`` (or ``>= at_least``)."""
    strict = above is not None
    bound = above if above is not None else at_least
    assert bound is not None, "finite() needs above= or at_least="
    sign = ">" if strict else ">="

    def check(value: float) -> str | None:
        low_ok = value > bound if strict else value >= bound
        return (
            None if math.isfinite(value) and low_ok else f"must be a finite number {sign} {bound:g}"
        )

    return check


def value_problem(cls: type, field: dataclasses.Field, value: Any) -> str | None:
    """``name=value <rule>`` when ``value`` does not fit ``field`` of ``cls``, else None."""
    kind, opt = field_kinds(cls)[field.name], option_of(field)
    if value is None and field.default is None:
        return None
    numeric = isinstance(value, (int, float)) and kind is float
    if isinstance(value, bool) != (kind is bool) or not (isinstance(value, kind) or numeric):
        return f"{field.name}={value!r} must be {KIND_NAMES[kind]}"
    if opt.choices is not None and value not in opt.choices:
        return f"{field.name}={value!r} must be one of {', '.join(map(repr, opt.choices))}"
    rule = opt.check(value) if opt.check else None
    return None if rule is None else f"{field.name}={value!r} {rule}"


def field_problems(config: Any) -> list[str]:
    """One ``name=value <rule>`` per field of ``config`` whose value breaks its own check."""
    found = (value_problem(type(config), f, getattr(config, f.name)) for f in fields_of(config))
    return [problem for problem in found if problem]


def fields_of(cls_or_config: Any) -> list[dataclasses.Field]:
    """The fields declared with :func:`option`, in declaration order."""
    return [f for f in dataclasses.fields(cls_or_config) if "option" in f.metadata]


def resume_keys(cls: type) -> tuple[str, ...]:
    """The names of the fields marked ``resume=True``, in declaration order."""
    return tuple(f.name for f in fields_of(cls) if option_of(f).resume)


def read_toml(path: str | Path, sections: Mapping[str, type]) -> dict[str, Any]:
    """The settings of a TOML file, ``{field name: value}``, each checked against its field.

    The file holds one table per section (``[step]``, ...) of the given settings classes; every
    key is optional. Integers are accepted where a number is expected.

    Raises:
        ConfigError: a missing or unreadable file, invalid TOML, a key outside the sections, a
            value of the wrong type or out of range; the message names the file and the key.
    """
    try:
        document = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(
            f"config file unreadable: path={str(path)!r}. {exc}. Give a TOML file "
            "(ddpkit train --print-config writes one)."
        ) from exc
    values, problems = {}, []
    for section, table in document.items():
        if section not in sections or not isinstance(table, dict):
            problems.append(_misplaced(section, sections))
            continue
        known = {f.name: f for f in fields_of(sections[section])}
        for key, value in table.items():
            if key not in known:
                problems.append(_unknown_key(section, key, sections))
                continue
            kind = field_kinds(sections[section])[key]
            value = float(value) if kind is float and type(value) is int else value
            problem = value_problem(sections[section], known[key], value)
            if problem:
                problems.append(f"[{section}] {problem}")
            values[key] = value
    if problems:
        raise ConfigError(
            f"bad config file: path={str(path)!r}. {'. '.join(problems)}. Fix these keys "
            "(ddpkit train --print-config shows every key)."
        )
    return values


def _owner(key: str, sections: Mapping[str, type]) -> str | None:
    found = [name for name, cls in sections.items() if key in {f.name for f in fields_of(cls)}]
    return found[0] if found else None


def _misplaced(name: str, sections: Mapping[str, type]) -> str:
    owner = _owner(name, sections)
    if owner is not None:
        return f"{name} is outside any section: it belongs in [{owner}]"
    return f"{name} is not a section (sections: {', '.join(sections)})"


def _unknown_key(section: str, key: str, sections: Mapping[str, type]) -> str:
    owner = _owner(key, sections)
    if owner is not None:
        return f"[{section}] {key} belongs in [{owner}]"
    names = ", ".join(f.name for f in fields_of(sections[section]))
    return f"[{section}] {key} is not a setting (the keys of [{section}]: {names})"


def to_toml(config: Any, sections: Mapping[str, type]) -> str:
    """``config`` as a TOML file that :func:`read_toml` reads back to the same values.

    Each key has its help as a comment; a value of ``None`` (unset) is written commented out.
    """
    lines = []
    for section, cls in sections.items():
        lines += ["", f"[{section}]  # {(cls.__doc__ or '').strip().splitlines()[0]}"]
        for field in fields_of(cls):
            value = getattr(config, field.name)
            lines += [f"# {line}" for line in textwrap.wrap(help_of(field), 96)]
            text = "unset" if value is None else _toml_value(value)
            lines.append(f"{'# ' if value is None else ''}{field.name} = {text}")
    return "\n".join(lines).lstrip() + "\n"


def _toml_value(value: bool | int | float | str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return {math.inf: "inf", -math.inf: "-inf"}.get(value, "nan")
    return json.dumps(value) if isinstance(value, str) else repr(value)
