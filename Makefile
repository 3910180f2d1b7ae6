# The two commands a newcomer runs on a fresh machine:
#   make run   — set up, start the whole stack on the embedded demo model, stream a few generations
#   make test  — set up, lint, run the whole test suite
# Both create .venv in the repo on first use; later runs skip the set-up while pyproject.toml is unchanged.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0

.PHONY: run test lint setup clean-venv demo-assets protos gpu-check

setup: $(STAMP)

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "make: '$(PYTHON)' not found: install Python 3.11 or newer, or run 'make PYTHON=/path/to/python3.11 ...'" >&2; exit 1; }
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' || { echo "make: loraserve needs Python >= 3.11; '$(PYTHON)' is $$($(PYTHON) -V 2>&1). Run 'make PYTHON=/path/to/python3.11 ...'" >&2; exit 1; }
	@$(PYTHON) -c 'import venv, ensurepip' 2>/dev/null || { echo "make: '$(PYTHON)' lacks the venv/ensurepip modules (Debian: apt install python3-venv)" >&2; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# torch first: a bare 'torch' requirement would pull a multi-GB CUDA build; the CPU wheel is pinned here.
	@$(PY) -c 'import torch' 2>/dev/null || $(PY) -m pip install --disable-pip-version-check -q "$(TORCH)" || { echo "make: could not install $(TORCH); set TORCH=... to another torch requirement" >&2; exit 1; }
	$(PY) -m pip install --disable-pip-version-check -q -e '.[dev]'
	@touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(VENV)/bin/pytest

run: $(STAMP)
	$(VENV)/bin/loraserve up --show-demo

# The GPU suite (tests, kernel benchmark, 7B-shaped engine, stack) on a CUDA machine, into out/gpu-check.
# Set TORCH to a CUDA build of torch there. On a bare GPU machine without a venv: deploy/gpu-check.sh.
gpu-check: $(STAMP)
	$(PY) -m loraserve.bench.gpu_check --out out/gpu-check $(GPU_CHECK_ARGS)

# Regenerate the embedded demo model and adapters (minutes of CPU; refuses to overwrite without FORCE=1).
demo-assets: $(STAMP)
	$(PY) -m loraserve.demo.build $(if $(FORCE),--force,)

# Regenerate the committed gRPC stubs in loraserve/v1 from proto/ (a test checks they are current).
protos: $(STAMP)
	$(PY) -m loraserve.protos

clean-venv:
	rm -rf $(VENV)
