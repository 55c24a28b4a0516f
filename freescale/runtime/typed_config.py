"""The one typed-config engine: a value given as command-line text, a TOML value or a `freescale
pipeline` section's key becomes a dataclass field's typed value here, checked the same way wherever it
came from. The trainer's config (``freescale.training.config``), the pipeline's config
(``freescale.jobs.workflow.config``) and every job's command line (``freescale.runtime.options``) use it.

What a field's type decides (:func:`coerce`):

- ``Literal[...]`` (or ``Annotated[str, OneOf(values)]``, a choice known at run time): one of its values,
  else one line naming the key and the allowed values;
- ``bool``: a TOML bool, or the text 1/true/yes/on, 0/false/no/off;
- ``int``, ``float``, ``str``: the type's own constructor (an int refuses a fractional number);
- ``X | None``: None stays None, anything else is an ``X``;
- ``tuple[X, ...]``, ``list[X]``: a TOML array, or text with ``,`` between items, each item an ``X``;
- a nested dataclass: a table (:func:`apply_table`), its unknown keys refused with one line naming the key.

Standard library only: jobs read configs and build their command lines before anything heavy loads.
"""
from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from freescale.runtime.errors import InputError

TRUE_TEXTS = ("1", "true", "yes", "on")
FALSE_TEXTS = ("0", "false", "no", "off")


class ConfigError(InputError):
    """A config file or override that does not fit the schema; the message names the key (bad input:
    exit 2, as every InputError)."""


@dataclass(frozen=True)
class OneOf:
    """A choice whose values are known only at run time, in ``Annotated[str, OneOf(values)]``: checked
    at load like a ``Literal`` (the same one line), against ``values()`` as it is then."""

    values: Callable[[], tuple[str, ...]]


def base_type(hint: Any) -> tuple[Any, bool]:
    """The field's type without None (a ``OneOf`` choice as the Literal of its values now), and whether
    None is allowed. A union of several types other than None is text."""
    if typing.get_origin(hint) is Annotated:
        base, *marks = typing.get_args(hint)
        choices = [mark for mark in marks if isinstance(mark, OneOf)]
        hint = Literal[choices[0].values()] if choices else base
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return (args[0] if len(args) == 1 else str), True
    return hint, False


def coerce(value: Any, hint: Any, where: str) -> Any:
    """`value` as a field of type `hint`; `where` (``SOURCE: section.key``) starts the error's line."""
    target, optional = base_type(hint)
    if value is None and optional:
        return None
    if typing.get_origin(target) is Literal:
        allowed = typing.get_args(target)
        if value not in allowed:
            raise ConfigError(f"{where} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
        return value
    if typing.get_origin(target) in (tuple, list):
        return _sequence(value, target, where)
    try:
        if target is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in TRUE_TEXTS:
                return True
            if str(value).lower() in FALSE_TEXTS:
                return False
            raise ValueError(value)
        if target is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        return target(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where} must be a valid {target.__name__}, got {value!r}") from None


def _sequence(value: Any, target: Any, where: str) -> Any:
    """A ``tuple[X, ...]`` or ``list[X]`` from a TOML array or ``,``-separated text."""
    container, args = typing.get_origin(target), typing.get_args(target)
    items = ([part.strip() for part in value.split(",")] if value.strip() else []) if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ConfigError(f"{where} must be a list, got {value!r}")
    item = args[0] if args else str
    return container(coerce(v, item, f"{where}[{i}]") for i, v in enumerate(items))


def text_type(target: type) -> Callable[[str], Any]:
    """A command line's ``type=`` for an int or float option: the text coerced as a config value is,
    a bad one raising ValueError so that argparse reports it in its own words
    (``argument --seed: invalid int value: 'x'``)."""
    def parse(text: str) -> Any:
        try:
            return coerce(text, target, "")
        except ConfigError:
            raise ValueError(text) from None

    parse.__name__ = target.__name__
    return parse


def check_choices(obj: Any, names: tuple[str, ...]) -> None:
    """For a config dataclass's ``__post_init__`` (a constructed value was not coerced): each named
    Literal field holds one of its values, else ValueError naming it (its section added at load)."""
    hints = typing.get_type_hints(type(obj))
    for name in names:
        allowed = typing.get_args(base_type(hints[name])[0])
        if getattr(obj, name) not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {getattr(obj, name)!r}")


def keyed_by(choice: Any, mapping: dict[str, Any]) -> dict[str, Any]:
    """`mapping` (choice -> implementation), checked at import to cover exactly the values of the
    Literal `choice`: the config's check is then the only check, and the two lists cannot drift."""
    allowed = typing.get_args(choice)
    if set(mapping) != set(allowed):
        raise TypeError(f"implementations {sorted(mapping)} do not match the config's choices {sorted(allowed)}")
    return mapping


def keys_of(obj: Any) -> dict[str, Any]:
    """Key -> type of every key of the config dataclass `obj`: its fields, then the sections it declares
    beyond them (an ``extra_sections()`` method: name -> section, e.g. registered encoders)."""
    hints = typing.get_type_hints(type(obj), include_extras=True)
    fields = {f.name: hints[f.name] for f in dataclasses.fields(obj)}
    extra = getattr(obj, "extra_sections", dict)()
    return {**fields, **{name: type(section) for name, section in extra.items()}}


def apply_table(obj: Any, values: dict[str, Any], source: str, prefix: str = "") -> None:
    """Set `values` (a TOML table) on the config dataclass `obj`, checking every key and value.

    `source` is the file or ``command line``; `prefix` the dotted key of `obj`, so errors read
    ``SOURCE: section.key ...``. A dataclass with a ``__post_init__`` check runs it again once its
    table is applied (its ValueError becomes ``SOURCE: section: ...``), so a file cannot set what the
    constructor would refuse.
    """
    hints = keys_of(obj)
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if key not in hints:
            raise ConfigError(f"{source}: unknown key {dotted!r} (known: {', '.join(sorted(hints))})")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: {dotted} must be a table")
            apply_table(current, value, source, dotted + ".")
        else:
            setattr(obj, key, coerce(value, hints[key], f"{source}: {dotted}"))
    post_init = getattr(obj, "__post_init__", None)
    if post_init is not None:
        try:
            post_init()
        except ValueError as exc:
            raise ConfigError(f"{source}: {prefix.rstrip('.')}: {exc}") from None


def read_toml(path: str | Path) -> dict[str, Any]:
    """A config file's table; a missing or malformed file is one ConfigError line naming it."""
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def parse_overrides(argv: list[str]) -> list[tuple[str, str]]:
    """``--section.key VALUE`` / ``--section.key=VALUE`` arguments as (``section.key``, text) pairs
    (``-`` in a key read as ``_``)."""
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"override {arg!r}: expected --section.key VALUE")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(argv):
                raise ConfigError(f"override {arg!r} has no value")
            key, value = arg[2:], argv[i + 1]
            i += 2
        pairs.append((key.replace("-", "_"), value))
    return pairs


def nested(key: str, value: Any) -> dict[str, Any]:
    """One dotted key's value as the table a file would give it: ``a.b.c = v`` -> ``{a: {b: {c: v}}}``."""
    *parents, leaf = key.split(".")
    table: dict[str, Any] = {leaf: value}
    for part in reversed(parents):
        table = {part: table}
    return table


def flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested table as ``a.b.c -> value``."""
    flat: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def to_flat_dict(config: Any, prefix: str = "") -> dict[str, Any]:
    """`section.key -> value` for every leaf of a config dataclass (e.g. what MLflow records as a
    training run's params)."""
    flat: dict[str, Any] = {}
    for key in keys_of(config):
        value = getattr(config, key)
        name = f"{prefix}{key}"
        if dataclasses.is_dataclass(value):
            flat.update(to_flat_dict(value, name + "."))
        else:
            flat[name] = value
    return flat
