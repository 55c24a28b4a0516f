"""The typed-config engine: each kind of value coerced from command-line text and TOML alike, and each
refusal one line naming the key."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Annotated, Literal

import pytest

from freescale.runtime import options
from freescale.runtime.errors import InputError
from freescale.runtime.typed_config import (ConfigError, OneOf, apply_table, base_type, check_choices, coerce, flatten,
                                            keyed_by, keys_of, nested, parse_overrides, read_toml, text_type,
                                            to_flat_dict)

Mode = Literal["fast", "slow"]
NAMES = ["a", "b"]
Pick = Annotated[str, OneOf(lambda: tuple(NAMES))]  # a choice among names registered at run time


@dataclass
class Inner:
    mode: Mode = "fast"
    depth: int = 1

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise ValueError(f"depth must be >= 1, got {self.depth}")


@dataclass
class Outer:
    flag: bool = False
    count: int = 0
    rate: float = 0.5
    limit: int | None = None
    widths: tuple[int, ...] = (1,)
    names: list[str] = field(default_factory=list)
    pick: Pick = "a"
    inner: Inner = field(default_factory=Inner)


@pytest.mark.parametrize("value,hint,expected", [
    ("true", bool, True), ("OFF", bool, False), (True, bool, True), ("1", bool, True),
    ("7", int, 7), (7.0, int, 7), (" 7 ", int, 7), ("2.5", float, 2.5), (3, float, 3.0), (5, str, "5"),
    (None, int | None, None), ("4", int | None, 4), ("slow", Mode, "slow"),
    ([1, "2"], tuple[int, ...], (1, 2)), ("1, 2,3", tuple[int, ...], (1, 2, 3)), ("", tuple[int, ...], ()),
    (["x", 1], list[str], ["x", "1"]), ("0.5,1", tuple[float, ...] | None, (0.5, 1.0)),
])
def test_each_kind_is_coerced(value, hint, expected):
    got = coerce(value, hint, "f.toml: s.k")
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize("value,hint,message", [
    ("maybe", bool, "f.toml: s.k must be a valid bool, got 'maybe'"),
    (2, bool, "f.toml: s.k must be a valid bool, got 2"),
    ("x1", int, "f.toml: s.k must be a valid int, got 'x1'"),
    (1.5, int, "f.toml: s.k must be a valid int, got 1.5"),
    ("1.5", int, "f.toml: s.k must be a valid int, got '1.5'"),
    ("fast-ish", float, "f.toml: s.k must be a valid float, got 'fast-ish'"),
    ("x", int | None, "f.toml: s.k must be a valid int, got 'x'"),
    ("medium", Mode, "f.toml: s.k must be one of 'fast', 'slow', got 'medium'"),
    (None, Mode, "f.toml: s.k must be one of 'fast', 'slow', got None"),
    ("1,x", tuple[int, ...], "f.toml: s.k[1] must be a valid int, got 'x'"),
    (3, list[int], "f.toml: s.k must be a list, got 3"),
])
def test_each_refusal_is_one_line_naming_the_key(value, hint, message):
    with pytest.raises(ConfigError) as refused:
        coerce(value, hint, "f.toml: s.k")
    assert str(refused.value) == message and isinstance(refused.value, InputError)


def test_a_choice_known_at_run_time_is_checked_against_its_values_then():
    hint = Pick
    assert base_type(hint) == (Literal["a", "b"], False)
    with pytest.raises(ConfigError, match="must be one of 'a', 'b', got 'c'"):
        coerce("c", hint, "k")
    NAMES.append("c")
    try:
        assert coerce("c", hint, "k") == "c"
    finally:
        NAMES.remove("c")


def test_a_table_sets_nested_sections_and_refuses_unknown_keys():
    config = Outer()
    apply_table(config, {"flag": "yes", "count": "3", "limit": 9, "widths": [4, 5], "pick": "b",
                         "inner": {"mode": "slow", "depth": 2}}, "f.toml")
    assert (config.flag, config.count, config.limit, config.widths, config.pick) == (True, 3, 9, (4, 5), "b")
    assert config.inner == Inner("slow", 2)
    refusals = [({"inner": {"speed": 1}}, "f.toml: unknown key 'inner.speed' (known: depth, mode)"),
                ({"colour": 1}, "f.toml: unknown key 'colour' (known: count, flag, inner, limit, names, pick, rate, "
                                "widths)"),
                ({"inner": 3}, "f.toml: inner must be a table"),
                ({"inner": {"mode": "warp"}}, "f.toml: inner.mode must be one of 'fast', 'slow', got 'warp'"),
                # a section's own check runs once its table is applied, its section named
                ({"inner": {"depth": 0}}, "f.toml: inner: depth must be >= 1, got 0")]
    for table, message in refusals:
        with pytest.raises(ConfigError) as refused:
            apply_table(Outer(), table, "f.toml")
        assert str(refused.value) == message


def test_overrides_read_as_the_tables_a_file_would_give():
    pairs = parse_overrides(["--inner.depth", "4", "--inner.mode=slow"])
    assert pairs == [("inner.depth", "4"), ("inner.mode", "slow")]
    config = Outer()
    for key, value in pairs:
        apply_table(config, nested(key, value), "command line")
    assert config.inner == Inner("slow", 4)
    assert nested("a.b.c", 1) == {"a": {"b": {"c": 1}}} and flatten({"a": {"b": {"c": 1}}, "d": 2}) == {"a.b.c": 1, "d": 2}
    assert to_flat_dict(config)["inner.depth"] == 4 and set(to_flat_dict(config)) == {
        "flag", "count", "rate", "limit", "widths", "names", "pick", "inner.mode", "inner.depth"}
    for argv, message in ((["depth", "1"], "override 'depth': expected --section.key VALUE"),
                          (["--inner.depth"], "override '--inner.depth' has no value")):
        with pytest.raises(ConfigError, match=message):
            parse_overrides(argv)


def test_extra_sections_are_keys_too():
    @dataclass
    class WithExtra:
        width: int = 1

        def extra_sections(self):
            return {"plugin": Inner()}

    assert keys_of(WithExtra()) == {"width": int, "plugin": Inner}


def test_a_file_that_is_missing_or_not_toml_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^config file .*nope\.toml does not exist$"):
        read_toml(tmp_path / "nope.toml")
    (tmp_path / "bad.toml").write_text("[s\n")
    with pytest.raises(ConfigError, match=r"^config file .*bad\.toml is not valid TOML: "):
        read_toml(tmp_path / "bad.toml")
    (tmp_path / "good.toml").write_text("[s]\nk = 1\n")
    assert read_toml(tmp_path / "good.toml") == {"s": {"k": 1}}


def test_a_constructed_choice_is_checked_by_its_post_init():
    @dataclass
    class Checked:
        mode: Mode = "fast"

        def __post_init__(self) -> None:
            check_choices(self, ("mode",))

    with pytest.raises(ValueError, match=r"^mode must be one of \('fast', 'slow'\), got 'warp'$"):
        Checked(mode="warp")
    assert Checked(mode="slow").mode == "slow"


def test_implementations_keyed_by_a_choice_cover_it():
    assert keyed_by(Mode, {"fast": 1, "slow": 2}) == {"fast": 1, "slow": 2}
    with pytest.raises(TypeError, match="do not match"):
        keyed_by(Mode, {"fast": 1})


# ---------------------------------------------------------------- the command line and a pipeline section

@dataclass(frozen=True, kw_only=True)
class DemoSpec:
    SURFACES = ("cli", "pipeline")
    steps: int = options.option(2, "steps per window", positive=True)
    rate: float = options.option(0.5, "a rate")
    limit: int | None = options.option(None, "at most this many")
    mode: Mode = options.option("fast", "how")
    verbose: bool = options.option(False, "say more")


def test_a_command_line_number_is_coerced_by_the_engine_in_argparse_words(capsys):
    parse = text_type(int)
    assert parse.__name__ == "int" and parse("12") == 12
    with pytest.raises(ValueError):
        parse("1.5")
    parser = argparse.ArgumentParser(prog="freescale demo-job")
    options.add_arguments(parser, DemoSpec)
    args = parser.parse_args(["--steps", "3", "--rate", "0.25", "--limit", "7", "--mode", "slow", "--verbose"])
    assert options.from_values(DemoSpec, vars(args)) == DemoSpec(steps=3, rate=0.25, limit=7, mode="slow", verbose=True)
    for argv, line in ((["--steps", "x1"], "argument --steps: invalid int value: 'x1'"),
                       (["--rate", "fast"], "argument --rate: invalid float value: 'fast'"),
                       (["--mode", "warp"], "argument --mode: invalid choice: 'warp' (choose from 'fast', 'slow')")):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
        assert capsys.readouterr().err.splitlines()[-1] == f"freescale demo-job: error: {line}"


def test_a_pipeline_section_loads_through_the_engine_into_the_same_spec():
    section = options.section(DemoSpec, "pipeline")

    Workflow = dataclasses.make_dataclass("Workflow", [("demo", section, field(default_factory=section))])
    config = Workflow()
    apply_table(config, {"demo": {"steps": 4, "limit": 0, "mode": "slow", "verbose": "true"}}, "p.toml")
    # TOML has no null: 0 is none for an optional number
    assert options.from_values(DemoSpec, options.section_values(config.demo)) == DemoSpec(
        steps=4, limit=None, mode="slow", verbose=True)
    with pytest.raises(ConfigError) as refused:
        apply_table(Workflow(), {"demo": {"steps": "many"}}, "p.toml")
    assert str(refused.value) == "p.toml: demo.steps must be a valid int, got 'many'"
    with pytest.raises(ConfigError, match=r"^p\.toml: unknown key 'demo\.stepz' \(known: limit, mode, rate, steps, "
                                          r"verbose\)$"):
        apply_table(Workflow(), {"demo": {"stepz": 1}}, "p.toml")
    assert [f.name for f in dataclasses.fields(section)] == ["steps", "rate", "limit", "mode", "verbose"]
