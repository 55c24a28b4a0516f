# Two commands on a fresh machine: `make demo` and `make test`. Both install first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-cpu

.PHONY: install demo test test-fast bench clean

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

test: install
	$(PY) -m pytest -q --durations=25 tests

test-fast: install
	$(PY) -m pytest -q -m "not slow" tests

bench: install
	$(PY) benchmarks/balance_bench.py

clean:
	rm -rf out spark-warehouse mlflow.db mlruns
