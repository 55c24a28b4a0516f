"""The house rules, read from the source: no import circle between library modules (lazy imports
included), no library function over 60 lines (Triton kernels aside), the data jobs never reach the
trainer, and training/ shows its rooms rather than its files."""
from __future__ import annotations

import pytest

from tests.layout.imports import (LIBRARY, MAX_FUNCTION_LINES, REPO_ROOT, circles, import_graph, long_functions,
                                  reachable)


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
    source.write_text("def f():\n    from training.model import registry\n    import runtime.errors\n")
    # `from training.model import registry` runs the package first, then the module
    assert imported_modules(source, "x.mod", {"training.model.registry", "training.model", "runtime.errors"}) == {
        "training.model", "training.model.registry", "runtime.errors"}


def test_no_library_function_is_over_60_lines():
    assert [f"{f.where} ({f.lines} lines)" for f in long_functions()] == []


def test_the_length_limit_counts_from_def_to_the_last_line(tmp_path, monkeypatch):
    from tests.layout import imports

    package = tmp_path / "runtime"
    package.mkdir()
    (package / "long.py").write_text("def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    monkeypatch.setattr(imports, "REPO_ROOT", tmp_path)
    monkeypatch.setattr(imports, "LIBRARY", ("runtime",))
    assert [(f.where, f.lines) for f in long_functions()] == [("runtime/long.py:1 f", MAX_FUNCTION_LINES + 1)]


def test_the_data_jobs_load_nothing_of_the_trainer(graph):
    loaded = reachable(graph, ["jobs.prepare", "jobs.balance"])
    assert sorted(m for m in loaded if m == "training" or m.startswith("training.")) == []


def test_the_library_flows_one_way_below_the_trainer(graph):
    # runtime is the floor; the data side (pipeline, balancing, shards) and tracking never import
    # the trainer or the jobs.
    above = {"runtime": ("pipeline", "balancing", "shards", "comm", "training", "tracking", "jobs"),
             "pipeline": ("balancing", "shards", "training", "jobs"),
             "balancing": ("shards", "training", "jobs"), "shards": ("training", "jobs"),
             "tracking": ("training", "jobs"), "comm": ("training", "jobs"), "training": ("jobs",)}
    wrong = [f"{m} -> {d}" for m, deps in graph.items() for d in deps
             if d.split(".")[0] in above.get(m.split(".")[0], ())]
    assert wrong == []


def test_training_shows_at_most_12_entries():
    entries = [p.name for p in (REPO_ROOT / "training").iterdir() if p.name != "__pycache__"]
    assert len(entries) <= 12, sorted(entries)
    assert set(LIBRARY) <= {p.name for p in REPO_ROOT.iterdir()}
