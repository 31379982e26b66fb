# `make demo` and `make test` each create or reuse .venv, install what is needed, and run.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.par4d-installed
TORCH  ?= torch==2.13.0
# The venv is isolated: the system's packages (and their pins) are not its business. A GPU
# user keeps the system's torch with `make test VENV_FLAGS=--system-site-packages`, or
# installs theirs into .venv first; a CPU torch is installed only when none is importable.
VENV_FLAGS ?=
PYTEST := $(PY) -m pytest -q

.PHONY: demo test test-isa lint bench setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.txt
	test -x $(PY) || python3 -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

# The demo runs the grid the planner picks for this machine (it calibrates first and says why).
demo: $(STAMP)
	$(VENV)/bin/par4d train --grid auto

test: $(STAMP)
	$(PY) -m ruff check par4d tests examples
	$(PYTEST)

# The suite under older CPUs' kernels: ATen's, oneDNN's and MKL's choice forced down to AVX2
# (a Zen 3 or Haswell machine), then to their baselines (no AVX at all in ATen). `make test`
# runs this machine's own.
test-isa: $(STAMP)
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 $(PYTEST)
	ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 MKL_ENABLE_INSTRUCTIONS=SSE4_2 $(PYTEST)

# No `ruff format --check`: the code aligns its trailing comments in columns and wraps signatures to the
# line, which the formatter would collapse and explode across 169 files (the checks below still hold the
# line length, imports, pyflakes, bugbear and pyupgrade).
lint: $(STAMP)
	$(PY) -m ruff check par4d tests examples

bench: $(STAMP)
	$(VENV)/bin/par4d bench grid --nproc 4

clean:
	rm -rf $(VENV) runs
