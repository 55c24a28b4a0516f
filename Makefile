# Two commands on a fresh machine: `make demo` and `make test`. Both install first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-cpu
DIST ?= dist

.PHONY: install demo test test-all test-fast fault-sweep bench dist clean spark-archive

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	# torchrec's metadata asks for the CUDA `fbgemm-gpu` wheel; fbgemm-gpu-cpu from
	# requirements.txt provides the module, so install torchrec without deps.
	$(PY) -m pip install -q --no-deps torchrec==1.8.0
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/freescale demo

# What CI runs: every test but the extended tier (docs/testing.md).
test: install
	$(PY) -m ruff check .
	$(PY) -m pytest -q --durations=25 -m "not extended" tests

# Every test: the extended tier too (a Spark standalone cluster, spark-submit, two nodes, Chromium,
# the demo's quality, the SASS checks, and second variants of end-to-end launches).
test-all: install
	$(PY) -m ruff check .
	$(PY) -m pytest -q --durations=25 tests

# The tier without Spark and without a second process (tests/conftest.py: --fast), which it checks.
test-fast: install
	$(PY) -m pytest -q --fast tests

# Once per machine, for faster later test runs: the archive of the classes a Spark job loads, which
# every Spark JVM of the suite then maps (tests/helpers.py: DataJobsRun). The suite never writes it.
spark-archive: install
	$(PY) -m tests.helpers

# The end-to-end tier's long sweep of bad inputs, stops and kills (about 16 minutes; not in `make test`).
fault-sweep: install
	$(PY) -m tests.e2e.fault_sweep

bench: install
	$(PY) -m benchmarks.balance_bench

# The wheel and sdist (`freescale` for a machine's venv), and the executors' zip for
# spark-submit --py-files: the wheel's packages without its metadata (a pure wheel is a zip
# of them; not its .pth hook, which only an installed wheel runs). No build isolation: the venv's setuptools builds it, offline.
dist: install
	rm -rf $(DIST)
	$(PY) -m build --no-isolation --outdir $(DIST) .
	$(PY) -c 'import sys, zipfile; wheel = zipfile.ZipFile(sys.argv[1]); \
	  out = zipfile.ZipFile(sys.argv[2], "w", zipfile.ZIP_DEFLATED); \
	  [out.writestr(i, wheel.read(i)) for i in wheel.infolist() if ".dist-info/" not in i.filename and ".data/" not in i.filename and not i.filename.endswith(".pth")]' \
	  $(DIST)/freescale-*.whl $(DIST)/freescale.zip

clean:
	rm -rf out spark-warehouse mlflow.db mlruns $(DIST) build
