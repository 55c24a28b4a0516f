"""The tests mirror the package (docs/testing.md): one tests/<room>/ per room of freescale/, and
besides them only the tiers and checks that belong to no room."""
from __future__ import annotations

from tests.layout.imports import PACKAGE, REPO_ROOT

BESIDE_THE_ROOMS = {"benchmarks", "e2e", "layout"}
"""tests/benchmarks/ (benchmarks/ at toy sizes), tests/e2e/ (the long fault sweep), tests/layout/ (the house rules)."""


def folders(root) -> set[str]:
    return {p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists()}


def test_every_room_has_its_test_folder_and_nothing_else_does():
    rooms, tests = folders(REPO_ROOT / PACKAGE), folders(REPO_ROOT / "tests")
    assert sorted(rooms - tests) == []
    assert sorted(tests - rooms - BESIDE_THE_ROOMS) == []
    assert all(any((REPO_ROOT / "tests" / room).glob("test_*.py")) for room in rooms)
