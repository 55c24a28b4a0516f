"""One declaration per job option: a job's spec is a frozen dataclass whose fields are declared with
:func:`option` (default written once, help, where it appears), and its command line, its
`freescale pipeline` section and the typed value its library takes are all derived from it.

    @dataclass(frozen=True, kw_only=True)
    class BalanceSpec:
        window_steps: int = option(1, "plan W global batches together ...", positive=True)

    add_arguments(parser, BalanceSpec, "cli")         # --window-steps WINDOW_STEPS (default 1)
    BalanceSection = section(BalanceSpec, "pipeline")  # [balance] window_steps = 1
    spec = from_values(BalanceSpec, vars(args))       # BalanceSpec(window_steps=...)

A *surface* is a name for one place the option is offered (``"cli"``: the job's own command line;
a job may declare others, e.g. balance's ``"pipeline"`` and ``"compare"``); an option is on every
surface its spec lists unless it names its own. A value's type is read, and a command line's number
coerced, by the typed-config engine (``freescale.runtime.typed_config``) that loads the config files and
the pipeline's sections. Standard library only: every job builds its parser from here before anything
heavy loads.
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Callable, Literal

from freescale.runtime.errors import InputError
from freescale.runtime.typed_config import base_type, text_type

ALL = "all"
"""``surfaces=ALL`` (the default): every surface the spec's ``SURFACES`` lists."""


@dataclass(frozen=True)
class Option:
    help: str
    surfaces: tuple[str, ...] | str = ALL
    positive: bool = False
    """Must be > 0 when given (None, for an optional value, is not given)."""
    helps: dict[str, str] = dataclasses.field(default_factory=dict)
    """Help on a given surface instead of ``help``."""
    parse: Callable[[str, dict[str, Any]], Any] | None = None
    """From the text given on a command line to the field's value, with the other values at hand
    (e.g. capacities need the world size); raises InputError for bad text."""
    metavar: str | None = None
    group: str | None = None
    """The title of the argument group it is listed under on a command line (None: the options)."""
    show_default: bool = True
    """Name the default in the command line's help (unless the help already speaks of it)."""
    exclusive: str | None = None
    """Options of one spec with the same name here are mutually exclusive on a command line."""


def option(default: Any = dataclasses.MISSING, help: str = "", **settings: Any) -> Any:  # noqa: A002
    """A spec field: its default (none: required), its help and the Option settings."""
    return dataclasses.field(default=default, metadata={"option": Option(help, **settings)})


def option_of(field: dataclasses.Field) -> Option | None:
    return field.metadata.get("option")


def on_surface(spec: type, surface: str) -> list[dataclasses.Field]:
    """The spec's option fields offered on ``surface``, in declaration order."""
    declared = getattr(spec, "SURFACES", ())
    chosen = []
    for field in dataclasses.fields(spec):
        opt = option_of(field)
        if opt is not None and surface in (declared if opt.surfaces == ALL else opt.surfaces):
            chosen.append(field)
    return chosen


def default_of(spec: type, name: str) -> Any:
    """A field's one default, for code that must name it outside the derived surfaces."""
    return next(f.default for f in dataclasses.fields(spec) if f.name == name)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _hints(spec: type) -> dict[str, Any]:
    return typing.get_type_hints(spec)


def add_arguments(parser: argparse.ArgumentParser, spec: type, surface: str = "cli", choices: bool = True,
                  only: tuple[str, ...] | None = None, skip: tuple[str, ...] = ()) -> None:
    """One ``--flag`` per option on ``surface`` (``only`` those, none of ``skip``): required when the
    field has no default, a switch for a bool, the Literal's values as choices (unless ``choices`` is
    False: the job checks them), the default named in the help unless the help already speaks of it."""
    hints, groups, exclusive = _hints(spec), {}, {}
    top = parser
    for field in on_surface(spec, surface):
        if (only is not None and field.name not in only) or field.name in skip:
            continue
        opt = option_of(field)
        parser = top if opt.group is None else groups.get(opt.group) or groups.setdefault(
            opt.group, top.add_argument_group(opt.group))
        if opt.exclusive is not None:
            parser = exclusive.get(opt.exclusive) or exclusive.setdefault(
                opt.exclusive, parser.add_mutually_exclusive_group())
        base, _ = base_type(hints[field.name])
        text = opt.helps.get(surface, opt.help)
        required = field.default is dataclasses.MISSING
        if (opt.show_default and not required and field.default is not None and field.default is not False
                and "default" not in text):
            text += f" (default {field.default})"
        if base is bool:
            parser.add_argument(flag(field.name), action="store_true", help=text)
            continue
        kwargs: dict[str, Any] = {"help": text, "metavar": opt.metavar}
        if typing.get_origin(base) is Literal:
            kwargs["choices"] = typing.get_args(base) if choices else None
        elif opt.parse is None and base in (int, float):
            kwargs["type"] = text_type(base)
        parser.add_argument(flag(field.name), required=required,
                            **({} if required else {"default": field.default}), **kwargs)


def from_values(spec: type, values: dict[str, Any]) -> Any:
    """The spec from parsed values (``vars(args)``: keys that are not fields are ignored): every
    ``positive`` option checked (one line naming its flag), then each option's ``parse`` applied to
    text, then the spec's own ``check()`` when it has one."""
    fields = {f.name: f for f in dataclasses.fields(spec)}
    chosen = {k: v for k, v in values.items() if k in fields}
    for name, value in chosen.items():
        opt = option_of(fields[name])
        if opt is not None and opt.positive and value is not None and value <= 0:
            kind = "a positive integer" if isinstance(value, int) else "positive"
            raise InputError(f"{flag(name)} must be {kind}, got {value}")
    for name, value in chosen.items():
        opt = option_of(fields[name])
        if opt is not None and opt.parse is not None and isinstance(value, str):
            chosen[name] = opt.parse(value, chosen)
    made = spec(**chosen)
    if hasattr(made, "check"):
        made.check()
    return made


# ------------------------------------------------------------------ a `freescale pipeline` section

def section(spec: type, surface: str = "pipeline", name: str | None = None,
            extra: tuple[tuple[str, Any, dataclasses.Field], ...] = ()) -> type:
    """A mutable dataclass of the spec's options on ``surface`` (then the ``extra`` fields, which are
    not the spec's), for a TOML section: the pipeline's loader checks its keys, Literal choices and
    types. TOML has no null, so an optional number is 0 there for none (an optional text: "");
    :func:`section_values` turns it back into None."""
    hints = _hints(spec)
    fields = []
    for field in on_surface(spec, surface):
        base, optional = base_type(hints[field.name])
        default = field.default
        if optional and default is None:
            if typing.get_origin(base) is Literal:  # "" stands for none among the choices
                base, default = Literal[("",) + typing.get_args(base)], ""
            else:
                default = "" if base is str else base(0)
        fields.append((field.name, base, dataclasses.field(default=default, metadata=field.metadata)))
    made = dataclasses.make_dataclass(name or f"{spec.__name__}Section", fields + list(extra))
    made.spec, made.__module__ = spec, spec.__module__
    return made


def section_values(section_obj: Any) -> dict[str, Any]:
    """A section's values as the spec takes them (0 or "" for an optional one: None); not its extra fields."""
    spec = type(section_obj).spec
    hints = _hints(spec)
    values = {}
    for field in dataclasses.fields(section_obj):
        if field.name not in hints:
            continue
        value = getattr(section_obj, field.name)
        if base_type(hints[field.name])[1] and not value:
            value = None
        values[field.name] = value
    return values
