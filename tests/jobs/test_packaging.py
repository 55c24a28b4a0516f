"""Packaging: `make dist` (python -m build's wheel and sdist, and the executors' zip for
spark-submit --py-files), and the wheel installed into a fresh venv running `freescale`."""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def project_modules() -> set[str]:
    """Every module file of the packages pyproject.toml ships, relative to the repo."""
    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    tops = {pattern.rstrip("*") for pattern in include}
    return {str(path.relative_to(REPO)) for top in tops for path in (REPO / top).rglob("*.py")
            if "__pycache__" not in path.parts}


def test_dist_holds_every_module_once(dist):
    wheel = zipfile.ZipFile(dist.wheel).namelist()
    modules = project_modules()
    assert {"freescale/jobs/cli.py", "freescale/prepare/ingest.py", "freescale/training/ops/hstu_attention.py"} <= modules
    metadata = {name for name in wheel if ".dist-info/" in name or ".data/" in name}
    hooks = {name for name in wheel if name.endswith(".pth")}
    assert hooks == {"freescale-exported-models.pth"}  # models exported before the one package (freescale/__init__.py)
    assert set(wheel) - metadata - hooks == modules  # no tests or benchmarks; no module left out
    # One top-level import name: every module under freescale/, and setuptools' own record says so.
    assert {name.split("/")[0] for name in modules} == {"freescale"}
    top_level = next(n for n in metadata if n.endswith("top_level.txt"))
    assert zipfile.ZipFile(dist.wheel).read(top_level).decode().split() == ["freescale"]
    shipped = {name.rsplit("/", 1)[1] for name in metadata if "/data/share/freescale/configs/" in name}
    assert shipped == {path.name for path in (REPO / "configs").glob("*.toml")}  # as data files, beside the code
    entry_points = zipfile.ZipFile(dist.wheel).read(next(n for n in metadata if n.endswith("entry_points.txt")))
    assert "freescale = freescale.jobs.cli:main" in entry_points.decode()
    assert sorted(zipfile.ZipFile(dist.zip).namelist()) == sorted(set(wheel) - metadata - hooks)
    with tarfile.open(dist.sdist) as sdist:
        root = dist.sdist.name.removesuffix(".tar.gz")
        names = {name.removeprefix(root + "/") for name in sdist.getnames()}
    assert {"pyproject.toml", "README.md"} | modules <= names


def test_the_wheel_installs_into_a_fresh_venv_and_runs(dist, tmp_path):
    fresh = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the shell of a machine without the repo
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    # The dependencies are this venv's (torch and pyspark are gigabytes, and the suite installs
    # nothing from the network): a path entry, not a site folder, so this venv's editable
    # install of the project (a .pth finder) is not seen; the project comes from the wheel only.
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                              "--no-index", str(dist.wheel)], cwd=tmp_path, env=fresh, capture_output=True, text=True,
                             timeout=120)
    assert install.returncode == 0, install.stderr[-2000:]

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(argv, cwd=tmp_path, env=fresh, capture_output=True, text=True, timeout=120)

    where = run(str(python), "-c", "import freescale.jobs.cli, freescale.prepare, freescale.training.ops; "
                "print(freescale.jobs.cli.__file__)")
    assert where.returncode == 0, where.stderr[-2000:]
    assert Path(where.stdout.strip()) == site / "freescale" / "jobs" / "cli.py"
    # A model exported before the one package imports the old names; the .pth hook maps them at start.
    old = run(str(python), "-c", "from runtime.errors import InputError; "
              "from training.export.exported_model import ExportedModel; import freescale.model as m; "
              "print(ExportedModel is m.ExportedModel and InputError is m.InputError)")
    assert old.returncode == 0 and old.stdout.split() == ["True"], old.stderr[-2000:]
    # `freescale demo` finds its configs in the installed copy, not in a checkout.
    configs = run(str(python), "-c", "from freescale.jobs.cli import shipped_configs; print(shipped_configs())")
    assert configs.returncode == 0, configs.stderr[-2000:]
    assert (Path(configs.stdout.strip()) / "demo_pipeline.toml").read_text() == \
        (REPO / "configs" / "demo_pipeline.toml").read_text()
    helped = run(str(venv / "bin" / "freescale"), "--help")
    assert helped.returncode == 0, helped.stderr[-2000:]
    assert helped.stdout.startswith("The `freescale` command") and "freescale simulate" in helped.stdout
    simulated = run(str(venv / "bin" / "freescale"), "simulate", "--lengths", "lognormal:4.2,0.9",
                    "--world-sizes", "8,64", "--tracking-uri", "none")
    assert simulated.returncode == 0, simulated.stderr[-2000:]
    planned = [line.split(" | ")[:2] for line in simulated.stdout.splitlines() if "| balanced |" in line]
    assert planned == [["| 8", "balanced"], ["| 64", "balanced"]], simulated.stdout
