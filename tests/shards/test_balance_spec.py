"""Balance's options are declared once (freescale/shards/balance_spec.py) and derived everywhere: its command line,
the pipeline's [balance] section and compare's balanced variant (freescale/runtime/options.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from freescale.runtime import options
from freescale.runtime.errors import InputError
from freescale.shards.balance_spec import BalanceSpec

REPO = Path(__file__).resolve().parents[2]
REQUIRED = {"input": "in", "output": "out", "world_size": 2, "local_batch_size": 4}

# A fresh interpreter, where a new option is one field added to BalanceSpec before any job is imported:
# what adding the field to freescale/shards/balance_spec.py does. It must reach balance's command line, a
# pipeline TOML and compare's balanced variant, with its default where nobody sets it.
NEW_OPTION = r'''
import json, sys
from dataclasses import dataclass
from pathlib import Path

import freescale.shards.balance_spec as balance_spec
from freescale.runtime.options import option


@dataclass(frozen=True, kw_only=True)
class WithNewOption(balance_spec.BalanceSpec):
    max_moves: int = option(7, "the most samples a window may move", positive=True)


balance_spec.BalanceSpec = WithNewOption
from freescale.jobs import balance, compare  # noqa: E402
from freescale.jobs.workflow import run as workflow  # noqa: E402
from freescale.runtime import options  # noqa: E402

tmp, seen = Path(sys.argv[1]), {}
required = ["--input", "in", "--output", "out", "--world-size", "2", "--local-batch-size", "4"]
parser = balance.build_parser()
seen["cli_help"] = "--max-moves" in parser.format_help()
for name, argv in (("cli", [*required, "--max-moves", "3"]), ("cli_default", required)):
    seen[name] = options.from_values(WithNewOption, vars(parser.parse_args(argv))).max_moves
try:
    options.from_values(WithNewOption, vars(parser.parse_args([*required, "--max-moves", "0"])))
except Exception as exc:
    seen["cli_refused"] = str(exc)

config = tmp / "pipeline.toml"
for name, text in (("pipeline", "[balance]\nmax_moves = 4\n"), ("pipeline_default", "")):
    config.write_text(f'[pipeline]\nworkdir = "{tmp / "work"}"\ntracking_uri = "none"\n' + text)
    loaded = workflow.load_workflow_config(str(config), [])
    specs = []
    balance.run = lambda spec_of, tracking: specs.append(spec_of()) or 0  # the stage's call, not the job
    compare.run = lambda spec_of, overrides, tracking: specs.append(spec_of()) or 0
    stages = {s.name: s for s in workflow.build_stages(loaded)}
    assert stages["balance"].run() == 0 and stages["compare"].run() == 0
    seen[name] = specs[0].max_moves
    seen[name + "_compare"] = specs[1].balanced["max_moves"]
seen["pipeline_override"] = workflow.load_workflow_config(str(config), ["--balance.max_moves", "5"]).balance.max_moves

(tmp / "prepared").mkdir()
(tmp / "prepared" / "prepare.json").write_text("{}")
for name, extra in (("compare", ["--max-moves", "6"]), ("compare_default", [])):
    args, overrides = compare.build_parser().parse_known_args(
        ["--input", str(tmp / "prepared"), "--world-size", "2", "--local-batch-size", "4", *extra])
    spec = compare.spec_of_args(args)
    compare.check_args(spec, overrides)
    specs = compare.shard_set_specs(spec, tmp / "compare")
    seen[name] = specs["balanced"].max_moves
    seen[name + "_baseline"] = specs["contiguous"].max_moves
print(json.dumps(seen))
'''


@pytest.mark.spawns  # a fresh interpreter: the option must be there before any job module is imported
def test_a_new_option_reaches_the_cli_the_pipeline_and_compare_from_its_declaration(tmp_path):
    run = subprocess.run([sys.executable, "-c", NEW_OPTION, str(tmp_path)], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen == {"cli_help": True, "cli": 3, "cli_default": 7,
                    "cli_refused": "--max-moves must be a positive integer, got 0",
                    "pipeline": 4, "pipeline_default": 7, "pipeline_override": 5,
                    # the pipeline's compare stage plans its balanced variant with [balance]'s options
                    "pipeline_compare": 4, "pipeline_default_compare": 7,
                    "compare": 6, "compare_default": 7,
                    # the contiguous baseline is the same shard set whatever the balanced variant's options
                    "compare_baseline": 7, "compare_default_baseline": 7}


def test_the_cli_states_each_default_once_from_the_spec():
    from freescale.jobs import balance, compare

    helps = {a.dest: a for a in balance.build_parser()._actions}
    assert helps["strategy"].default == "kk" and helps["strategy"].help == "partition strategy (default kk)"
    assert helps["window_steps"].help.endswith("(default 1)") and helps["token_cap"].default is None
    assert helps["equal_counts"].default is False and helps["seed"].help.endswith("(default 0)")
    compared = {a.dest: a for a in compare.build_parser()._actions}
    assert compared["strategy"].help == "the balanced variant's strategy (default kk)"
    assert compared["strategy"].choices is None  # compare checks them itself (and refuses contiguous)
    assert compared["seed"].default == options.default_of(BalanceSpec, "seed")
    assert "flop_width" not in compared  # an option names the surfaces it is on


def test_the_pipeline_section_takes_zero_for_none():
    from freescale.jobs.workflow.config import BalanceSection, CompareSection

    section = BalanceSection()
    assert (section.strategy, section.token_cap, section.time_limit) == ("kk", 0, 0.0)
    assert CompareSection().strategy == "kk"
    section.token_cap = 512
    values = options.section_values(section)
    assert values["token_cap"] == 512 and values["time_limit"] is None
    assert set(values) == {"strategy", "window_steps", "seed", "equal_counts", "token_cap", "leftover", "time_limit"}


@pytest.mark.parametrize("values, message", [
    ({"world_size": 0}, "--world-size must be a positive integer, got 0"),
    ({"window_steps": -1}, "--window-steps must be a positive integer, got -1"),
    ({"time_limit": 0.0}, "--time-limit must be positive, got 0.0"),
    ({"capacities": "1,2,3"}, "--capacities has 3 values, --world-size is 2"),
    ({"strategy": "flops_kk", "window_steps": 2}, "--window-steps must be 1, got 2"),
])
def test_bad_values_are_one_line(values, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(")):
        options.from_values(BalanceSpec, {**REQUIRED, **values})


def test_capacities_text_becomes_the_tuple_the_executors_get():
    spec = options.from_values(BalanceSpec, {**REQUIRED, "capacities": "1.5,0.5"})
    assert spec.capacities == (1.5, 0.5) and spec.global_batch_size == 8 and spec.window_size == 8


def test_the_spec_hands_every_planner_option_to_the_planner():
    """Each ``PlanOptions`` field comes from the spec: with every planning option off its default,
    none of the windows' options is left at the planner's default."""
    from dataclasses import fields

    from freescale.balancing import PlanOptions

    spec = BalanceSpec(**REQUIRED, strategy="ortools", window_steps=3, token_cap=500, equal_counts=True,
                       capacities=(1.0, 0.5), seed=2, time_limit=0.5, flop_width=32)
    asked, default = spec.plan_options(window=7), PlanOptions()
    left = [f.name for f in fields(PlanOptions) if getattr(asked, f.name) == getattr(default, f.name)]
    assert left == []
    assert asked.seed != spec.plan_options(window=8).seed  # windows do not share tie-breaking
