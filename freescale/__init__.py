"""FreeScale: straggler-free distributed training of sequence recommenders. One package, one room per
concern (README's layout table): runtime, tracking, prepare, costs, balancing, shards, comm, training,
launch, jobs; ``freescale.model`` is the name every exported model imports.

Models exported before the project was one package carry a copy of their MLflow loader that imports
the project's old top-level names (``training.exported_model``, ``training.export.exported_model``,
``runtime.errors``). Those names still import, as their modules' homes here, once ``freescale`` is
imported: by the project itself, and at interpreter start where the wheel is installed (its
``freescale-exported-models.pth``), so ``mlflow models serve`` loads such a model without the
project having been imported first. Only these names, and only when nothing else on the path
provides them: the wheel ships one top-level import name, ``freescale``.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

MOVED = {"training.exported_model": "freescale.training.export.exported_model",
         "training.export.exported_model": "freescale.training.export.exported_model",
         "runtime.errors": "freescale.runtime.errors"}
"""Old module name -> its home now, for what was written before a move and names the old one."""
PARENTS = {"training", "training.export", "runtime"}
"""The old names' parents: empty placeholder packages, so only the names above import through them."""


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a moved module's old name as the module itself (one object under both names); last on
    ``sys.meta_path``, so a real package of one of the old names wins."""

    def find_spec(self, name: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if name in MOVED:
            return importlib.util.spec_from_loader(name, self)
        if name in PARENTS:
            return importlib.util.spec_from_loader(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec):
        return importlib.import_module(MOVED[spec.name]) if spec.name in MOVED else None

    def exec_module(self, module) -> None:
        """Nothing to run: a moved module ran under its own name; a placeholder package holds nothing."""
        if module.__name__ in PARENTS:
            module.__path__ = []


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())
