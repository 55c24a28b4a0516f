"""The trainer: TorchRec ranks that stream their shards, exchange embeddings while they compute, and
measure every step's bubble. One concern per sub-package (README's layout table).

A model exported before the trainer was split into sub-packages carries a copy of its MLflow loader
that imports ``training.exported_model``; that name still imports, as the module's new home.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

MOVED = {"training.exported_model": "training.export.exported_model"}
"""Old module name -> its home now, for what was written before the move and names the old one."""


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a moved module's old name as the module itself (one object under both names)."""

    def find_spec(self, name: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec):
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module) -> None:
        """Nothing to run: the module ran under its own name."""


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())
