# `make demo` and `make test` each create or reuse .venv, install what is needed, and run.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.par4d-installed
TORCH  ?= torch==2.13.0

.PHONY: demo test lint bench setup clean

setup: $(STAMP)

# The venv sees system packages, so a GPU user's torch is kept; a CPU torch is
# installed only when no torch is importable.
$(STAMP): pyproject.toml requirements.txt
	test -x $(PY) || python3 -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/par4d train

test: $(STAMP)
	$(PY) -m ruff check par4d tests
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check par4d tests
	$(PY) -m ruff format --check par4d tests

bench: $(STAMP)
	$(VENV)/bin/par4d bench grid --nproc 4

clean:
	rm -rf $(VENV) runs
