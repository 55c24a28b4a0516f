"""The house rules, read from the source: no import circle between library modules (lazy imports
included), no library function over 60 lines (Triton kernels aside), the data jobs never reach the
trainer, and freescale/training/ shows its rooms rather than its files."""
from __future__ import annotations

import pytest

from tests.layout.imports import (LIBRARY, MAX_FUNCTION_LINES, PACKAGE, REPO_ROOT, circles, import_graph,
                                  jobs_module_strings, long_functions, reachable, room)


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_no_import_circle_between_library_modules(graph):
    assert circles(graph) == []


def test_the_circle_finder_finds_a_lazy_circle():
    # What the first test relies on: a circle closed by an import inside a function counts.
    graph = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": {"a.x"}}
    assert circles(graph) == [["a.x", "a.y", "a.z"]]


def test_the_graph_sees_lazy_and_relative_imports(tmp_path):
    from tests.layout.imports import imported_modules

    source = tmp_path / "mod.py"
    source.write_text("def f():\n    from freescale.training.model import registry\n    import freescale.runtime.errors\n")
    # `from freescale.training.model import registry` runs the package first, then the module
    assert imported_modules(source, "x.mod", {"freescale.training.model.registry", "freescale.training.model", "freescale.runtime.errors"}) == {
        "freescale.training.model", "freescale.training.model.registry", "freescale.runtime.errors"}


def test_no_library_function_is_over_60_lines():
    assert [f"{f.where} ({f.lines} lines)" for f in long_functions()] == []


def test_the_length_limit_counts_from_def_to_the_last_line(tmp_path, monkeypatch):
    from tests.layout import imports

    package = tmp_path / PACKAGE / "runtime"
    package.mkdir(parents=True)
    (package / "long.py").write_text("def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    monkeypatch.setattr(imports, "REPO_ROOT", tmp_path)
    assert [(f.where, f.lines) for f in long_functions()] == [(f"{PACKAGE}/runtime/long.py:1 f", MAX_FUNCTION_LINES + 1)]


def test_the_data_jobs_load_nothing_of_the_trainer(graph):
    loaded = reachable(graph, ["freescale.jobs.prepare", "freescale.jobs.balance"])
    assert sorted(m for m in loaded if room(m) == "training") == []


def test_the_library_flows_one_way(graph):
    # runtime is the floor; the data side (prepare, costs, balancing, shards) and tracking never import
    # the trainer, the launch room or the jobs; the trainer never imports what launches it; nothing below
    # the exported model's name (freescale.model, and the loader MLflow runs) imports it.
    top = ("training", "launch", "jobs", "model", "model_pyfunc")
    above = {"runtime": ("tracking", "prepare", "costs", "balancing", "shards", "comm") + top,
             "tracking": top, "prepare": ("balancing", "shards", "costs") + top, "costs": ("prepare", "balancing", "shards") + top,
             "balancing": ("shards",) + top, "shards": top, "comm": top,
             "training": ("launch", "jobs", "model", "model_pyfunc"), "launch": ("jobs", "model", "model_pyfunc"),
             "model": ("launch", "jobs", "model_pyfunc")}
    wrong = [f"{m} -> {d}" for m, deps in graph.items() for d in deps if room(d) in above.get(room(m), ())]
    assert wrong == []


def test_training_starts_no_jobs_module_by_name():
    # A rank starts nothing; what starts processes by module name (`python -m freescale.jobs...`) is launch/.
    assert jobs_module_strings("training") == []


def test_the_jobs_string_rule_finds_one(tmp_path, monkeypatch):
    from tests.layout import imports

    package = tmp_path / PACKAGE / "training"
    package.mkdir(parents=True)
    (package / "starts.py").write_text('"""Starts `python -m freescale.jobs.train` (a docstring may say so)."""\n'
                                       'CMD = ["-m", "freescale.jobs.train"]\n')
    monkeypatch.setattr(imports, "REPO_ROOT", tmp_path)
    assert jobs_module_strings("training") == [f"{PACKAGE}/training/starts.py:2 'freescale.jobs.train'"]


def test_training_shows_at_most_12_entries():
    entries = [p.name for p in (REPO_ROOT / PACKAGE / "training").iterdir() if p.name != "__pycache__"]
    assert len(entries) <= 12, sorted(entries)
    assert set(LIBRARY) <= {p.name for p in (REPO_ROOT / PACKAGE).iterdir()}


def test_the_repository_has_one_package():
    # Beside freescale/ only what is not installed: tests, benchmarks, configs, docs.
    packages = {p.name for p in REPO_ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert packages == {PACKAGE, "tests", "benchmarks"}
