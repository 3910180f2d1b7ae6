# The two commands a newcomer runs on a fresh machine:
#   make run   — set up, start the whole stack on the embedded demo model, stream a few generations
#                (gRPC on 127.0.0.1:50051, the OpenAI-compatible HTTP API on 127.0.0.1:8000)
#   make test  — set up, lint (Python and protos), run the whole test suite
# Both create .venv in the repo on first use; later runs skip the set-up while pyproject.toml is unchanged.
# make test also installs the buf CLI from npm into node_modules (package.json), again only when it changed.
# While changing code: make test-unit — the unit tests alone (tests/unit, under a minute; tests/README.md).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0
NPM_STAMP := node_modules/.installed
BUF       := node_modules/.bin/buf
# The release `buf breaking` compares with: the newest baseline in proto/releases (`make proto-release`).
PROTO_BASELINE = $(shell ls proto/releases/loraserve-*.json 2>/dev/null | sort -V | tail -n 1)

.PHONY: run test test-unit lint lock setup clean-venv demo-assets protos proto-check proto-release gpu-check docs-targets

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "make: '$(PYTHON)' not found: install Python 3.11 or newer, or run 'make PYTHON=/path/to/python3.11 ...'" >&2; exit 1; }
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' || { echo "make: loraserve needs Python >= 3.11; '$(PYTHON)' is $$($(PYTHON) -V 2>&1). Run 'make PYTHON=/path/to/python3.11 ...'" >&2; exit 1; }
	@$(PYTHON) -c 'import venv, ensurepip' 2>/dev/null || { echo "make: '$(PYTHON)' lacks the venv/ensurepip modules (Debian: apt install python3-venv)" >&2; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# torch first: a bare 'torch' requirement would pull a multi-GB CUDA build; the CPU wheel is pinned here.
	@$(PY) -c 'import torch' 2>/dev/null || $(PY) -m pip install --disable-pip-version-check -q "$(TORCH)" || { echo "make: could not install $(TORCH); set TORCH=... to another torch requirement" >&2; exit 1; }
	@# The rest with uv (seconds, where pip takes minutes), held to the torch installed above and to the
	@# versions in constraints.txt; pip if uv fails.
	@$(PY) -c 'import torch; print("torch==" + torch.__version__)' > $(VENV)/torch-constraint.txt
	$(PY) -m pip install --disable-pip-version-check -q uv && \
		$(VENV)/bin/uv pip install --python $(PY) -q -c $(VENV)/torch-constraint.txt -c constraints.txt -e '.[dev]' \
		|| $(PY) -m pip install --disable-pip-version-check -q -c constraints.txt -e '.[dev]'
	@touch $(STAMP)

# Resolve pyproject.toml's dependencies afresh in a scratch venv and write the versions to constraints.txt
# (torch, triton and the installers left out: TORCH picks those).
lock:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	.venv-lock/bin/pip install --disable-pip-version-check -q "$(TORCH)" uv
	.venv-lock/bin/uv pip install --python .venv-lock/bin/python -q -e '.[dev]'
	{ sed -n '/^#/p' constraints.txt; .venv-lock/bin/uv pip freeze --python .venv-lock/bin/python --exclude-editable \
		| grep -viE '^(torch|triton|pip|setuptools|uv)=='; } > constraints.txt.new && mv constraints.txt.new constraints.txt
	rm -rf .venv-lock

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The folders whose tests start no role processes and hold no wall-clock bounds run on TEST_WORKERS
# processes (pytest-xdist; one file stays on one worker); tests/stack (real processes, sockets, latency
# bounds) runs alone after them, as a loaded CPU would stretch its timings. Both run even if the first
# fails. tests/project/test_test_split.py keeps the two lists covering every folder of tests/.
TEST_WORKERS   ?= 2
PARALLEL_TESTS := tests/unit tests/numerics tests/fuzz tests/gpu tests/project
SERIAL_TESTS   := tests/stack

test: lint proto-check
	@status=0; \
	$(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadfile $(PARALLEL_TESTS) || status=$$?; \
	$(VENV)/bin/pytest $(SERIAL_TESTS) || status=$$?; \
	exit $$status

# The unit tests of every package (tests/unit: no processes, no sockets to other roles), with the
# property tests' examples fixed (CI=true) so that a run is quick and repeatable. tests/README.md: the folders.
test-unit: $(STAMP)
	CI=true $(VENV)/bin/pytest tests/unit

run: $(STAMP)
	$(VENV)/bin/loraserve up --show-demo --http-bind 127.0.0.1:8000

# The GPU suite (tests, kernel benchmark, 7B-shaped engine, stack) on a CUDA machine, into out/gpu-check.
# Set TORCH to a CUDA build of torch there. On a bare GPU machine without a venv: deploy/gpu-check.sh.
gpu-check: $(STAMP)
	$(VENV)/bin/loraserve bench --suite gpu-check --out out/gpu-check $(GPU_CHECK_ARGS)

# Regenerate the embedded demo model and adapters (minutes of CPU; refuses to overwrite without FORCE=1).
demo-assets: $(STAMP)
	$(PY) -m loraserve.demo.build $(if $(FORCE),--force,)

# Regenerate the docs' tables of targets from the committed results they name (a test checks they are current).
docs-targets: $(STAMP)
	$(PY) -m loraserve.bench.docs_targets

# Regenerate the committed gRPC stubs in loraserve/v1 from proto/ (a test checks they are current).
protos: $(STAMP)
	$(PY) -m loraserve.protos

# buf, pinned in package.json and package-lock.json (`npm install` there after changing the version).
# Not `npm ci`: it refuses a lockfile without all of buf's per-platform binary packages, and the lockfile
# holds only those of Linux (the registry this was locked against serves no others); `npm install
# --no-save` installs what the lockfile pins and leaves it as it is. --ignore-scripts: buf's postinstall
# only fetches its binary when npm did not install it.
$(NPM_STAMP): package.json package-lock.json
	@command -v npm >/dev/null 2>&1 || { echo "make: 'npm' not found: make test lints the protos with buf, which is installed from npm (package.json); install Node.js and npm, then retry" >&2; exit 1; }
	npm install --no-save --ignore-scripts --no-audit --no-fund
	@touch $(NPM_STAMP)

# Lint the protos (rules and deliberate exceptions: buf.yaml), then fail on any change that breaks
# clients of the last release of loraserve.v1.
proto-check: $(NPM_STAMP)
	@echo "$(BUF) lint"
	@$(BUF) lint || { echo "make proto-check: 'buf lint' failed on the findings above: fix the .proto files, or add a deliberate exception, with its reason, to buf.yaml" >&2; exit 1; }
	@test -n "$(PROTO_BASELINE)" || { echo "make proto-check: no release baseline in proto/releases: run 'make proto-release VERSION=...'" >&2; exit 1; }
	@echo "$(BUF) breaking --against $(PROTO_BASELINE)"
	@$(BUF) breaking --against $(PROTO_BASELINE) || { echo "make proto-check: 'buf breaking' failed: the changes above break clients of loraserve.v1 as released in $(PROTO_BASELINE). Add instead of changing (new fields, new RPCs; deprecate, do not delete), or start loraserve.v2" >&2; exit 1; }

# At a release: record the protos as they are now as the baseline proto-check compares with (VERSION=0.2.0).
proto-release: $(NPM_STAMP)
	@test -n "$(VERSION)" || { echo "make proto-release: name the release: make proto-release VERSION=0.2.0" >&2; exit 1; }
	@test ! -e proto/releases/loraserve-$(VERSION).json || { echo "make proto-release: proto/releases/loraserve-$(VERSION).json exists already" >&2; exit 1; }
	@mkdir -p proto/releases
	$(BUF) build --exclude-source-info -o proto/releases/.image.json
	$(PYTHON) -m json.tool --indent 1 proto/releases/.image.json proto/releases/loraserve-$(VERSION).json
	@rm proto/releases/.image.json
	@echo "wrote proto/releases/loraserve-$(VERSION).json: commit it"

clean-venv:
	rm -rf $(VENV)
