"""setuptools' build step, beside pyproject.toml: the wheel also ships freescale-exported-models.pth at its
root, one line that imports ``freescale`` when an interpreter of that environment starts, so models
exported before the project was one package load (``freescale/__init__.py``). A .pth file is not an
import name: the wheel's one top-level import name stays ``freescale``."""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "freescale-exported-models.pth"


class BuildWithPth(build_py):
    def run(self):
        super().run()
        Path(self.build_lib, PTH).write_text("import freescale\n")

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib, PTH))]


setup(cmdclass={"build_py": BuildWithPth})
